"""SeededDraw draws torch.multinomial's tokens from the same seed, step after step, and falls
back to torch.multinomial wherever its own variates would not be torch's."""

import pytest
import torch

from rlflow.engine.rollout import draw
from rlflow.engine.rollout.draw import SeededDraw

CPU = torch.device("cpu")


def rows(generator: torch.Generator, shape=(8, 4096), dtype=torch.float32, masked: bool = False) -> torch.Tensor:
    logits = torch.randn(shape, generator=generator, dtype=torch.float64) * 4
    if masked:  # top-p leaves most entries at probability 0
        logits[:, shape[1] // 8 :] = float("-inf")
    return logits.softmax(-1).to(dtype)


def torch_tokens(seed: int, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.multinomial(p, 1, generator=generator).squeeze(1) for p in batches]


@pytest.mark.parametrize("seed", [0, 11, 2**32 + 5, 2**63 - 1])
def test_tokens_are_torch_multinomials_step_after_step(seed):
    source = torch.Generator().manual_seed(seed % 1000)
    batches = [rows(source, masked=step % 2 == 1) for step in range(6)]
    sampler = SeededDraw(seed, CPU)
    ours = [sampler(p) for p in batches]
    assert sampler._fast is True
    for mine, theirs in zip(ours, torch_tokens(seed, batches)):
        assert torch.equal(mine, theirs)
    assert len({tuple(t.tolist()) for t in ours}) == len(ours)  # the stream advances between draws


def test_the_variates_are_torchs_exponential_bit_for_bit():
    sampler = SeededDraw(7, CPU)
    expected = torch.empty(3 * 8 * 49152).exponential_(1.0, generator=torch.Generator().manual_seed(7))
    ours = torch.from_numpy(draw._exponential(sampler._bits, expected.numel()))
    assert torch.equal(ours, expected)


def test_a_stream_unlike_torchs_falls_back_to_torch_multinomial(monkeypatch):
    exponential = draw._exponential
    monkeypatch.setattr(draw, "_exponential", lambda bits, count: exponential(bits, count) * 2)
    batches = [rows(torch.Generator().manual_seed(step)) for step in range(3)]
    sampler = SeededDraw(3, CPU)
    ours = [sampler(p) for p in batches]
    assert sampler._fast is False
    assert all(torch.equal(a, b) for a, b in zip(ours, torch_tokens(3, batches)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_use_torch_multinomial(dtype):
    batches = [rows(torch.Generator().manual_seed(step), dtype=dtype) for step in range(3)]
    sampler = SeededDraw(5, CPU)
    ours = [sampler(p) for p in batches]
    assert sampler._fast is False
    assert all(torch.equal(a, b) for a, b in zip(ours, torch_tokens(5, batches)))


@pytest.mark.parametrize(
    "bad, message",
    [(float("nan"), "`nan` or element < 0"), (-0.1, "`nan` or element < 0"), (0.0, "sum of probabilities")],
)
def test_invalid_rows_raise_torchs_error(bad, message):
    probs = rows(torch.Generator().manual_seed(0))
    sampler = SeededDraw(0, CPU)
    sampler(probs)  # the fast path is on before the bad row arrives
    if bad == 0.0:
        probs[2] = 0.0
    else:
        probs[2, 5] = bad
    with pytest.raises(RuntimeError, match=message):
        sampler(probs)
