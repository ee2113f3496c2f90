"""Memory and throughput features change how a step is computed, never what it computes: token-
budget micro-batches, row-capped micro-batches, sequence packing, gradient checkpointing and the
eager attention kernel all give the loss and updated weights of one whole-batch step (1e-5)."""

import warnings

import pytest
import torch

from rlflow.engine.backend.runtime import OptimSpec, Runtime
from rlflow.engine.data.batching import encode_pair
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.data.records import load_preference_pairs, load_sft_examples
from rlflow.engine.models.loading import load_policy, load_scalar_model, load_tokenizer
from rlflow.engine.stages.reward_model import _pair_rows, rm_train_step
from rlflow.engine.stages.sft import sft_train_step
from conftest import assert_weights_agree
from helpers.stage_ctx import make_ctx

TOLERANCE = 1e-5
VARIANTS = {
    "token_budget": (EngineConfig(max_tokens_per_microbatch=120), {}),
    "rows": (EngineConfig(micro_batch_size=3), {}),
    "packed": (EngineConfig(packing=True, max_tokens_per_microbatch=200), {}),
    "checkpointing": (EngineConfig(gradient_checkpointing=True, max_tokens_per_microbatch=200), {}),
    "eager_attention": (EngineConfig(), {"attn_implementation": "eager"}),
}


def sft_step(sft_dir, assets, tmp_path, engine_cfg, **load_kwargs):
    tokenizer = load_tokenizer(sft_dir)
    rows = [encode_pair(tokenizer, e.prompt, e.response, 64) for e in load_sft_examples(f"{assets}/data/sft.jsonl")]
    runtime = Runtime(engine_cfg)
    engine = runtime.trainable("model", lambda: load_policy(sft_dir, **load_kwargs), OptimSpec(1e-3, 0.01, 0, 10, 1.0))
    engine.train()
    out = sft_train_step(engine, runtime, rows, tokenizer.pad_token_id, 16, 1, make_ctx(tmp_path, "sft"))
    return out, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def rm_step(sft_dir, rm_dir, assets, tmp_path, engine_cfg):
    tokenizer = load_tokenizer(sft_dir)
    rows = _pair_rows(tokenizer, list(load_preference_pairs(f"{assets}/data/preferences.jsonl")), 64)
    runtime = Runtime(engine_cfg)

    def load():
        model = load_scalar_model(rm_dir)
        model.config.pad_token_id = tokenizer.pad_token_id
        return model

    engine = runtime.trainable("model", load, OptimSpec(1e-3, 0.0, 0, 10, 1.0))
    engine.train()
    ones = torch.ones(len(rows), 1)  # one head: every pair once
    out = rm_train_step(engine, runtime, rows, ones, tokenizer.pad_token_id, 16, 1, make_ctx(tmp_path, "rm"))
    return out, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def assert_same_step(reference, variant, loss_key, weights_too=True):
    """Same loss and gradient norm; same updated weights unless the kernels themselves differ
    (conftest.assert_weights_agree: rounding in a near-zero gradient can move single weights)."""
    (ref_out, ref_weights), (out, weights) = reference, variant
    assert out[loss_key] == pytest.approx(ref_out[loss_key], abs=TOLERANCE)
    grad_key = loss_key.split("/")[0] + "/grad_norm"
    assert out[grad_key] == pytest.approx(ref_out[grad_key], rel=TOLERANCE)
    if weights_too:
        assert_weights_agree(ref_weights, weights, TOLERANCE)


@pytest.fixture(scope="module")
def whole_sft_step(trained, small_assets, tmp_path_factory):
    return sft_step(trained[0], small_assets, tmp_path_factory.mktemp("whole"), EngineConfig())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_sft_step_is_unchanged_by(name, trained, small_assets, tmp_path, whole_sft_step):
    engine_cfg, load_kwargs = VARIANTS[name]
    variant = sft_step(trained[0], small_assets, tmp_path, engine_cfg, **load_kwargs)
    assert_same_step(whole_sft_step, variant, "sft/loss", weights_too=not load_kwargs)


@pytest.mark.parametrize(
    "engine_cfg",
    [EngineConfig(packing=True, max_tokens_per_microbatch=300), EngineConfig(max_tokens_per_microbatch=150)],
)
def test_reward_model_step_is_unchanged_by_packing_and_token_budgets(engine_cfg, trained, small_assets, tmp_path):
    sft_dir, rm_dir, _ = trained
    whole = rm_step(sft_dir, rm_dir, small_assets, tmp_path, EngineConfig())
    assert_same_step(whole, rm_step(sft_dir, rm_dir, small_assets, tmp_path, engine_cfg), "rm/loss")


def test_budgets_really_cut_the_batch():
    lengths = [10, 50, 12, 40, 30, 8, 64, 20]
    padded = Runtime(EngineConfig(max_tokens_per_microbatch=120)).micro_batches(lengths)
    packed = Runtime(EngineConfig(max_tokens_per_microbatch=120, packing=True)).packed_micro_batches(lengths)
    for groups, cost in (
        (padded, lambda g: max(lengths[i] for i in g) * len(g)),
        (packed, lambda g: sum(lengths[i] for i in g)),
    ):
        assert sorted(i for g in groups for i in g) == list(range(8)) and len(groups) > 1
        assert all(cost(g) <= 120 or len(g) == 1 for g in groups)
    assert len(packed) < len(padded)  # padding-free micro-batches hold more rows per pass


def test_flash_attention_falls_back_to_sdpa_with_a_warning(trained):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_policy(trained[0], attn_implementation="flash_attention_2")
    assert any("flash_attention_2" in str(w.message) and "using sdpa" in str(w.message) for w in caught)
    assert model.config._attn_implementation == "sdpa"
