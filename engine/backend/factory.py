"""`make_runtime`: the torch runtime, or the DeepSpeed one when `engine.backend: deepspeed`
(imported only then, so a CPU install never needs DeepSpeed)."""

from __future__ import annotations

import torch

from rlflow.engine.backend.cpu_memory import keep_freed_memory
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.config.execution import EngineConfig


def make_runtime(cfg: EngineConfig) -> Runtime:
    """The runtime for this process: torch, or DeepSpeed (imported only when asked for)."""
    if not torch.cuda.is_available():  # a CPU process: every step's allocations stay in the heap
        keep_freed_memory()
    if cfg.backend == "deepspeed":
        from rlflow.engine.backend.deepspeed_runtime import DeepSpeedRuntime

        return DeepSpeedRuntime(cfg)
    return Runtime(cfg)
