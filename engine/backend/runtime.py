"""One training interface for every stage: a single torch process or a DeepSpeed ZeRO job.

A `Runtime` owns the process (rank, device, collectives) and builds models: `trainable` ones
wrapped in a `TrainEngine` (optimizer, schedule, gradient clipping, checkpoint state) and
`frozen` ones for scoring. Algorithms stay pure functions outside: a stage hands
`TrainEngine.train_step` its micro-batches and a loss function returning `LossParts`.

Loss normalisation is global: every micro-batch's summed loss is divided by the number of loss
units (tokens or sequences) of the whole step over all micro-batches and ranks, so the gradient
equals one big batch's mean no matter how the batch is cut (a mean of per-rank token-means is
not that when lengths differ).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rlflow.engine.backend import dist
from rlflow.engine.backend.optim import adam_step_tensor, make_optimizer, make_schedule
from rlflow.engine.backend.optim_state import ParamState, ShardReader
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.config.model import LoraConfig
from rlflow.engine.data.batching import micro_batch_groups
from rlflow.engine.models.lora import apply_lora, is_lora_model, merged_named_parameters


@dataclass(frozen=True)
class OptimSpec:
    lr: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    max_grad_norm: float


@dataclass(frozen=True)
class LossParts:
    """What a loss function returns for one micro-batch."""

    loss_sum: torch.Tensor  # 0-dim, the loss summed over the micro-batch's loss units
    units: float  # number of loss units in it (tokens or sequences)
    stats: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric -> (sum, count)


LossFn = Callable[[nn.Module, Any], LossParts]


class TrainEngine:
    """A trainable model with its optimizer and schedule; backends override the hooks."""

    def __init__(self, name: str, forward: nn.Module, model: nn.Module, schedule: Any):
        self.name = name
        self.forward = forward  # call this for training forward passes (a DeepSpeed engine or the model)
        self.model = model  # the plain HF model: generate, config, save
        self.schedule = schedule
        self.poison_loss = False  # fault injection (RLFLOW_FAULT "<stage>:nonfinite:<step>"): losses become NaN

    # -- hooks ---------------------------------------------------------------------------------
    def _backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, step optimizer and schedule, zero gradients; return (pre-clip global grad norm,
        whether the step was applied: a non-finite norm skips it, optimizer and schedule untouched)."""
        raise NotImplementedError

    def _discard_gradients(self) -> None:
        """Drop accumulated gradients without an optimizer step."""
        raise NotImplementedError

    def param_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def full_param_state(self, name: str) -> ParamState:
        """Full fp32 state of one parameter; a collective under ZeRO-3 (all ranks, same order)."""
        raise NotImplementedError

    def restore_param(self, name: str, reader: ShardReader) -> None:
        """Load one parameter's weight and Adam state from a checkpoint's shards (any world size
        wrote them); backends that partition the state read only their own part."""
        raise NotImplementedError

    def adam_step(self) -> int:
        raise NotImplementedError

    def set_adam_step(self, step: int) -> None:
        raise NotImplementedError

    def gathered_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on rank 0 (None elsewhere); a collective under ZeRO-3."""
        return self.model.state_dict() if dist.is_main() else None

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter, one at a time (weight sync, fingerprints). A LoRA
        model yields its merged weights under the plain model's names: what a full copy holds."""
        if is_lora_model(self.model):
            yield from merged_named_parameters(self.model)
            return
        yield from self.model.named_parameters()

    # -- shared --------------------------------------------------------------------------------
    def train(self) -> None:
        self.model.train()

    def train_step(self, micro_batches: Sequence[Any], units: Sequence[float], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (units[i]: loss units in micro_batches[i]).

        Ranks with fewer micro-batches repeat their last one with weight 0: ZeRO's collectives in
        forward and backward need the same number of passes on every rank.
        Returns "loss" (global mean per unit), "grad_norm", "lr", "skipped" (1.0 when a non-finite
        loss or gradient norm skipped the update) and each stat's global sum/count.
        """
        if not micro_batches:
            raise ValueError(f"{self.name}: a rank got no micro-batches; the batch must have at least one row per rank")
        total_units = float(dist.all_reduce_sum(float(sum(units))))
        scale = dist.world_size() / max(total_units, 1e-12)  # ranks' gradients are averaged, not summed
        passes = dist.all_reduce_max(len(micro_batches))
        loss_total, stats = 0.0, {}
        for i in range(passes):
            real = i < len(micro_batches)
            parts = loss_fn(self.forward, micro_batches[min(i, len(micro_batches) - 1)])
            loss_sum = parts.loss_sum * float("nan") if self.poison_loss else parts.loss_sum
            self._backward(loss_sum * (scale if real else 0.0))
            if real:
                loss_total += float(loss_sum.detach())
                for key, (s, c) in parts.stats.items():
                    acc = stats.setdefault(key, [0.0, 0.0])
                    acc[0], acc[1] = acc[0] + float(s), acc[1] + float(c)
        keys = sorted(stats)
        reduced = dist.all_reduce_sum(torch.tensor([loss_total] + [v for k in keys for v in stats[k]]))
        loss = float(reduced[0]) / max(total_units, 1e-12)
        if math.isfinite(loss):  # every rank sees the same reduced loss, so all take the same branch
            grad_norm, applied = self._optimizer_step()
        else:
            self._discard_gradients()
            grad_norm, applied = float("nan"), False
        out = {"loss": loss, "grad_norm": grad_norm, "units": total_units, "skipped": float(not applied)}
        out["lr"] = float(self.schedule.get_last_lr()[0])
        for j, key in enumerate(keys):
            out[key] = float(reduced[1 + 2 * j]) / max(float(reduced[2 + 2 * j]), 1e-12)
        return out


class TorchTrainEngine(TrainEngine):
    def __init__(self, name: str, model: nn.Module, optim: OptimSpec):
        self.optimizer = make_optimizer(model, optim.lr, optim.weight_decay)
        super().__init__(name, model, model, make_schedule(self.optimizer, optim.warmup_steps, optim.total_steps))
        self.max_grad_norm = optim.max_grad_norm
        self._params = dict(model.named_parameters())
        self._pending_step = 0

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _optimizer_step(self) -> tuple[float, bool]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        applied = math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    def _discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_param_state(self, name: str) -> ParamState:
        param = self._params[name]
        state = self.optimizer.state.get(param, {})
        zeros = torch.zeros_like(param, dtype=torch.float32)
        return ParamState(param.detach().float(), state.get("exp_avg", zeros), state.get("exp_avg_sq", zeros))

    @torch.no_grad()
    def restore_param(self, name: str, reader: ShardReader) -> None:
        param, state = self._params[name], reader.get(name)
        param.copy_(state.master.to(param.dtype))
        self.optimizer.state[param] = {
            "step": adam_step_tensor(self._pending_step, param),
            "exp_avg": state.exp_avg.to(param.dtype).clone(),
            "exp_avg_sq": state.exp_avg_sq.to(param.dtype).clone(),
        }

    def adam_step(self) -> int:
        steps = [int(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return max(steps, default=0)

    def set_adam_step(self, step: int) -> None:
        self._pending_step = step  # applied as each parameter's state is loaded


class Runtime:
    """The process's backend: builds trainable and frozen models, knows rank, device and how
    batches are cut into micro-batches. This base class is the single-process torch backend."""

    name = "torch"
    device = torch.device("cpu")

    def __init__(self, cfg: EngineConfig | None = None):
        self.cfg = cfg or EngineConfig()

    def micro_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Positions of this rank's rows (of these token lengths) grouped into micro-batches."""
        return micro_batch_groups(lengths, self.cfg.micro_batch_size, self.cfg.max_tokens_per_microbatch)

    def packed_micro_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """As micro_batches, for rows that will be packed (the budget counts real tokens only)."""
        return micro_batch_groups(lengths, self.cfg.micro_batch_size, self.cfg.max_tokens_per_microbatch, packed=True)

    def inference(self) -> contextlib.AbstractContextManager:
        """For rollout, reference and reward passes: torch.inference_mode (no autograd records, no
        version counters). ZeRO-3 gets no_grad instead: its hooks gather weights into the
        parameters during forward, and an inference-mode tensor there would poison training."""
        return (
            torch.no_grad() if self.cfg.backend == "deepspeed" and self.cfg.zero_stage == 3 else torch.inference_mode()
        )

    @contextlib.contextmanager
    def onloaded(self, *models: nn.Module) -> Iterator[None]:
        """With engine.offload_frozen_models on a GPU, frozen models (reference, reward) live in CPU
        memory and come to the GPU only for the rollout-and-scoring phase, leaving the update phase
        their memory. A no-op on the CPU and under ZeRO-3 (engine.offload_params covers that)."""
        active = self.cfg.offload_frozen_models and self.device.type == "cuda" and self.cfg.zero_stage != 3
        if not active:
            yield
            return
        for model in models:
            model.to(self.device)
        try:
            yield
        finally:
            for model in models:
                model.to("cpu")
            torch.cuda.empty_cache()

    def _prepare(self, model: nn.Module) -> nn.Module:
        if self.cfg.gradient_checkpointing:
            # Non-reentrant checkpointing works with frozen inputs and keyword arguments.
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model

    def trainable(
        self, name: str, load: Callable[[], nn.Module], optim: OptimSpec, lora: LoraConfig | None = None
    ) -> TrainEngine:
        """`load()`'s model with an optimizer; with `lora` (model.lora), fresh LoRA adapters on it
        are all that trains (the optimizer and its checkpoint shards see only them)."""
        model = load()
        return TorchTrainEngine(name, self._prepare(apply_lora(model, lora) if lora else model), optim)

    def frozen(self, load: Callable[[], nn.Module]) -> nn.Module:
        model = load().eval()
        model.requires_grad_(False)
        return model

    def generate_kwargs(self) -> dict[str, Any]:
        """Extra arguments for HF `generate` (ZeRO-3 needs every rank in every forward pass)."""
        return {}

    def close(self) -> None:
        pass
