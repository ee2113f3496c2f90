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
from rlflow.engine.backend import dist
from rlflow.engine.errors import ConfigError, NonFiniteUpdates
from rlflow.engine.backend.deepspeed_import import import_deepspeed
from rlflow.engine.backend.runtime import OptimSpec, Runtime, TrainEngine
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.config.model import LoraConfig
from rlflow.engine.backend.optim_state import MOMENTS, ParamState, ShardReader
from rlflow.engine.backend.optim import adam_step_tensor, make_optimizer, make_schedule
from torch import nn


def _single_process_env() -> None:
    """A bare single process would make DeepSpeed look for MPI; describe a world of one instead."""
    if "RANK" in os.environ:
        return
    from rlflow.engine.backend.launch import free_port

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
        if self.zero_stage == 3:  # its param groups hold a flat only while that sub-group steps
            flats = list(self.engine.optimizer.fp32_partitioned_groups_flat)
        else:
            flats = [flat for group in self.engine.optimizer.optimizer.param_groups for flat in group["params"]]
        for flat in flats:
            state[flat] = {
                "step": adam_step_tensor(step, flat),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
        if self.zero_stage in (1, 2):  # ZeRO-1/2 map per-parameter views onto the flat state lazily
            self.engine.optimizer._hp_optimizer_states_linked = False
            self.engine.optimizer._lazy_init_hp_params_optimizer_state()

    @torch.no_grad()
    def restore_param(self, name: str, reader: ShardReader) -> None:
        """Load what this rank keeps of one parameter, reading only that much where ZeRO
        partitions it: ZeRO-3 its slice of weight and state; ZeRO-1/2 the whole weight (every
        rank holds the module's) and its fragment of the master and Adam state."""
        param = self._params[name]
        if self.zero_stage == 3:
            self._restore_partition(name, param, reader)
            return
        master = reader.get_range(name, "master", 0, param.numel()).view(param.shape)
        param.copy_(master.to(param.dtype))
        mapping = param._hp_mapping  # None: this rank holds no fragment of it
        if mapping is not None:
            start, numel = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            mapping.get_hp_fragment().data.copy_(master.flatten()[start : start + numel])
            for key in MOMENTS:
                mapping.get_hp_fragment(key).data.copy_(reader.get_range(name, key, start, start + numel))

    def _restore_partition(self, name: str, param: torch.nn.Parameter, reader: ShardReader) -> None:
        """ZeRO-3: the partition is a contiguous slice of the flattened parameter (the last one
        zero-padded), at the position DeepSpeed's own full setter uses."""
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        size = param.ds_tensor.numel()
        start = size * param._z3_optimizer._get_param_partition_rank(param)

        def local(part: str) -> torch.Tensor:
            values = reader.get_range(name, part, min(start, param.ds_numel), min(start + size, param.ds_numel))
            return torch.cat([values, values.new_zeros(size - values.numel())])

        master = local("master")
        safe_set_local_fp32_param(param, master)
        for key in MOMENTS:
            safe_set_local_optimizer_state(param, local(key), key)
        param.ds_tensor.data.copy_(master.to(param.ds_tensor.dtype))  # the module's own partition

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
        deepspeed = import_deepspeed()  # the first import in a rank: MLflow stays out

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

    def trainable(
        self, name: str, load: Callable[[], nn.Module], optim: OptimSpec, lora: LoraConfig | None = None
    ) -> TrainEngine:
        if lora is not None:
            raise ConfigError(
                "model.lora needs engine.backend=torch for now: LoRA adapters under DeepSpeed ZeRO are not"
                " supported yet; set engine.backend=torch or remove model.lora"
            )
        import deepspeed

        config = ds_config(self.cfg, optim.max_grad_norm, self.bf16, train=True)
        model = self._prepare(self._load(load, config))
        optimizer = make_optimizer(model, optim.lr, optim.weight_decay, fuse=False)  # steps flat partitions
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
