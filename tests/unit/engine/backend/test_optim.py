"""The optimizer: the fused AdamW kernel the torch backend uses agrees with the per-tensor loop."""

import torch

from rlflow.engine.backend.runtime import OptimSpec, Runtime
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.backend.optim import make_optimizer


def _adamw_after_steps(fuse: bool, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 5))
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.01, fuse=fuse)
    assert optimizer.defaults["fused"] is fuse
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():  # gradients across nine orders of magnitude, as in real models
            scale = 10.0 ** torch.randint(-9, 0, p.shape, generator=generator).float()
            p.grad = torch.randn(p.shape, generator=generator) * scale
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_matches_the_per_tensor_loop():
    fused, loop = _adamw_after_steps(True), _adamw_after_steps(False)
    moved = max(float((a - b).abs().max()) for a, b in zip(fused, _initial()))
    assert moved > 1e-3  # three steps of lr 1e-3 really moved the weights
    assert max(float((a - b).abs().max()) for a, b in zip(fused, loop)) < 1e-7


def _initial() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 5))
    return [p.detach().clone() for p in model.parameters()]


def test_the_torch_backend_steps_with_the_fused_kernel_on_the_cpu():
    engine = Runtime(EngineConfig()).trainable("m", lambda: torch.nn.Linear(4, 2), OptimSpec(1e-3, 0.0, 0, 0, 1.0))
    assert engine.optimizer.defaults["fused"] is True
