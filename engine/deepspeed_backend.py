"""The DeepSpeed ZeRO backend: every stage's trainable and frozen models in one DeepSpeed job.

As in DeepSpeed-Chat, actor, critic, reference and reward model share the process group; under
ZeRO-3 frozen models are partitioned too (an engine without optimizer). The client optimizer is
the same torch AdamW the torch backend uses, so the two backends agree to rounding.

Gradient accumulation is unmanaged (`managed_gradient_accumulation: false`): `step()` is the
boundary, so the number of micro-batches may change from step to step (token-budget batching).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rlflow.engine import dist
from rlflow.engine.errors import NonFiniteUpdates
from rlflow.engine.backend import OptimSpec, Runtime, TrainEngine
from rlflow.engine.config import EngineConfig
from rlflow.engine.optim_state import MOMENTS, ParamState
from rlflow.engine.train_state import make_optimizer, make_schedule
from torch import nn


def _single_process_env() -> None:
    """A bare single process would make DeepSpeed look for MPI; describe a world of one instead."""
    if "RANK" in os.environ:
        return
    from rlflow.engine.launch import free_port

    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    )


def ds_config(cfg: EngineConfig, max_grad_norm: float | None, bf16: bool, train: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3:
        # Unmanaged accumulation supports overlap_comm only under ZeRO-2; small frozen layers stay whole.
        zero.update(overlap_comm=False, stage3_param_persistence_threshold=0, stage3_max_live_parameters=int(1e9))
    if train and cfg.offload_optimizer and cfg.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": dist.world_size(),
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # the torch AdamW (no compiled CPUAdam) keeps parity
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train:
        config["managed_gradient_accumulation"] = False
        config["gradient_clipping"] = max_grad_norm
    return config


class DeepSpeedTrainEngine(TrainEngine):
    def __init__(self, name: str, engine: Any, schedule: Any, zero_stage: int):
        super().__init__(name, engine, engine.module, schedule)
        self.engine = engine
        self.zero_stage = zero_stage
        self._params = dict(engine.module.named_parameters())

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self) -> tuple[float, bool]:
        self.engine.step()
        raw = self.engine.get_global_grad_norm()
        if raw is None:  # this configuration did not compute one
            return float("nan"), True
        if not math.isfinite(float(raw)):
            # DeepSpeed reports the norm only after applying the step: the weights are suspect now,
            # so the stage stops before anything commits them.
            raise NonFiniteUpdates(
                f"{self.name}: non-finite gradient norm under DeepSpeed, after the optimizer applied it; the stage "
                "stops with the last committed checkpoint intact: lower the learning rate or check the data"
            )
        return float(raw), True

    def _discard_gradients(self) -> None:
        # ZeRO has already reduced the non-finite gradients into its own partitioned buffers, and
        # DeepSpeed offers no public way to drop them: stepping would corrupt weights and Adam
        # state, so the stage stops here instead of skipping (the last checkpoint is intact).
        raise NonFiniteUpdates(
            f"{self.name}: non-finite loss under DeepSpeed; the update cannot be skipped there, so the stage stops "
            "with the last committed checkpoint intact: lower the learning rate or check the data, then run again"
        )

    def _inner_state(self) -> dict:
        return self.engine.optimizer.optimizer.state

    def full_param_state(self, name: str) -> ParamState:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        param = self._params[name]
        master = safe_get_full_fp32_param(param)
        if not self._inner_state():  # no step taken yet: Adam's moments are still zero
            zeros = torch.zeros_like(master)
            return ParamState(master.cpu(), zeros.cpu(), zeros.cpu())
        moments = [safe_get_full_optimizer_state(param, key) for key in MOMENTS]
        return ParamState(master.cpu(), *(m.cpu() for m in moments))

    def adam_step(self) -> int:
        steps = [int(s["step"]) for s in self._inner_state().values() if "step" in s]
        return max(steps, default=0)

    def set_adam_step(self, step: int) -> None:
        """Create Adam's state (zero moments at `step`) so the full-state setters have somewhere to write."""
        state = self._inner_state()
        for group in self.engine.optimizer.optimizer.param_groups:
            for flat in group["params"]:
                state[flat] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": torch.zeros_like(flat),
                    "exp_avg_sq": torch.zeros_like(flat),
                }
        if self.zero_stage in (1, 2):  # ZeRO-1/2 map per-parameter views onto the flat state lazily
            self.engine.optimizer._hp_optimizer_states_linked = False
            self.engine.optimizer._lazy_init_hp_params_optimizer_state()

    @torch.no_grad()
    def load_param_state(self, name: str, state: ParamState) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        param = self._params[name]
        safe_set_full_fp32_param(param, state.master)
        for key, value in zip(MOMENTS, (state.exp_avg, state.exp_avg_sq)):
            safe_set_full_optimizer_state(param, value, key)
        # The module's own (possibly bf16, possibly partitioned) copy must match the master now,
        # not only after the next step.
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if dist.is_main():
                    param.copy_(state.master.to(param.dtype))
        else:
            param.copy_(state.master.to(param.dtype))

    def gathered_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return super().gathered_state_dict()

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.zero_stage != 3:
            yield from self.model.named_parameters()
            return
        import deepspeed

        for name, param in self.model.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.detach().clone()


class DeepSpeedRuntime(Runtime):
    name = "deepspeed"

    def __init__(self, cfg: EngineConfig):
        import deepspeed

        super().__init__(cfg)
        _single_process_env()
        self.on_gpu = torch.cuda.is_available()
        deepspeed.init_distributed(dist_backend="nccl" if self.on_gpu else "gloo")
        self.device = torch.device("cuda", dist.local_rank()) if self.on_gpu else torch.device("cpu")
        if self.on_gpu:
            torch.cuda.set_device(self.device)
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.on_gpu)
        self._keep: list[Any] = []  # HfDeepSpeedConfig objects: transformers only holds weak references

    def _load(self, load: Callable[[], nn.Module], config: dict[str, Any]) -> nn.Module:
        if self.cfg.zero_stage != 3:
            return load()
        from transformers.integrations import HfDeepSpeedConfig

        # With a live ZeRO-3 HfDeepSpeedConfig, from_pretrained builds each layer partitioned
        # (zero.Init): a 70B model never exists whole in one process.
        hf_config = HfDeepSpeedConfig(config)
        self._keep.append(hf_config)
        try:
            return load()
        finally:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()

    def trainable(self, name: str, load: Callable[[], nn.Module], optim: OptimSpec) -> TrainEngine:
        import deepspeed

        config = ds_config(self.cfg, optim.max_grad_norm, self.bf16, train=True)
        model = self._prepare(self._load(load, config))
        optimizer = make_optimizer(model, optim.lr, optim.weight_decay)
        engine, _, _, schedule = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: make_schedule(opt, optim.warmup_steps, optim.total_steps),
            config=config,
        )
        return DeepSpeedTrainEngine(name, engine, schedule, self.cfg.zero_stage)

    def frozen(self, load: Callable[[], nn.Module]) -> nn.Module:
        config = ds_config(self.cfg, None, self.bf16, train=False)
        model = self._load(load, config)
        model.requires_grad_(False)
        if self.cfg.zero_stage == 3:
            import deepspeed

            model = deepspeed.initialize(model=model, config=config)[0].module
        elif self.bf16:
            model = model.to(torch.bfloat16)
        if self.cfg.offload_frozen_models and self.cfg.zero_stage != 3:
            return model.eval()  # on the CPU until Runtime.onloaded brings it over
        return model.to(self.device).eval()

    def generate_kwargs(self) -> dict[str, Any]:
        # Under ZeRO-3 each forward all-gathers weights: a rank whose samples all ended must keep
        # stepping until every rank is done, or the others hang in the gather.
        return {"synced_gpus": True} if self.cfg.zero_stage == 3 and dist.world_size() > 1 else {}

    def close(self) -> None:
        dist.barrier()
