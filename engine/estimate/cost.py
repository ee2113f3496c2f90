"""What a training stage will cost before it starts: memory per GPU, time per step, GPU-hours,
money, and the cheapest way to spread it over GPUs that fits. The RL stage for every
algorithm.name (PPO, GRPO, RLOO, REINFORCE++: a Workload) or the DPO stage (a DPOWorkload).

Pure arithmetic over typed inputs: the model shapes (estimate_model), the device and its price
(estimate_hardware), the workload and strategy (estimate_workload); memory (estimate_memory) and
time (estimate_time) hold the formulas. docs/estimate.md explains them and compares them with
published runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from rlflow.engine.estimate.hardware import DeviceSpec
from rlflow.engine.estimate.memory import GIB, MemoryEstimate, estimate_dpo_memory, estimate_memory, vllm_gpus_needed
from rlflow.engine.estimate.timing import StepTime, estimate_dpo_step_time, estimate_step_time
from rlflow.engine.estimate.workload import OFFLOADS, AnyWorkload, BackendPrecisions, DPOWorkload, Strategy, Workload

# A plan fits when its peak stays this share below the device's memory: allocator spikes,
# NCCL buffers that grow with the world size and the estimate's own error need the room.
MEMORY_MARGIN = 0.10
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# Plans within this share of the cheapest GPU-hours count as equally cheap: the simplest wins.
COST_TIE = 0.05


@dataclass(frozen=True)
class Estimate:
    """One workload under one strategy on one device type."""

    workload: AnyWorkload
    strategy: Strategy
    device: DeviceSpec
    memory: MemoryEstimate
    step: StepTime
    steps: int
    gpus_billed: int  # training GPUs + a vLLM server's own GPUs
    currency: str
    setup_s: float = 0.0  # seconds once per stage besides the steps: DPO's reference pass

    @property
    def usable_bytes(self) -> float:
        """Device memory a plan may fill (MEMORY_MARGIN kept free)."""
        return self.device.memory_gib * GIB * (1 - MEMORY_MARGIN)

    @property
    def usable_host_bytes(self) -> float:
        """Host RAM per node a plan may fill (MEMORY_MARGIN kept free)."""
        return self.device.host_memory_gib * GIB * (1 - MEMORY_MARGIN)

    @property
    def fits(self) -> bool:
        """Peak device memory, host memory per node and a vLLM server's GPUs all within bounds."""
        rollout_ok = self.memory.rollout_gpu_capacity == 0 or self.memory.rollout_concurrency >= 1
        host_ok = self.memory.cpu_ram_per_node <= self.usable_host_bytes
        return self.memory.peak.total <= self.usable_bytes and host_ok and rollout_ok

    @property
    def total_hours(self) -> float:
        return (self.step.total * self.steps + self.setup_s) / 3600

    @property
    def gpu_hours(self) -> float:
        return self.total_hours * self.gpus_billed

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.device.price_per_gpu_hour


def estimate_rl(w: AnyWorkload, s: Strategy, device: DeviceSpec, currency: str) -> Estimate:
    """Memory, time and cost of `w` run under `s` on `device` GPUs priced in `currency`: the RL
    stage of any algorithm (a Workload), or the DPO stage (a DPOWorkload: estimate_dpo)."""
    if isinstance(w, DPOWorkload):
        return estimate_dpo(w, s, device, currency)
    memory = estimate_memory(w, s, device)
    return Estimate(
        workload=w,
        strategy=s,
        device=device,
        memory=memory,
        step=estimate_step_time(w, s, device, memory),
        steps=w.steps,
        gpus_billed=s.n_gpus + w.rollout_gpus,
        currency=currency,
    )


def estimate_dpo(w: DPOWorkload, s: Strategy, device: DeviceSpec, currency: str) -> Estimate:
    """Memory, time and cost of the DPO stage: w.steps optimizer steps plus the reference pass once."""
    step, reference_s = estimate_dpo_step_time(w, s, device)
    memory = estimate_dpo_memory(w, s, device)
    return Estimate(w, s, device, memory, step, w.steps, s.n_gpus, currency, setup_s=reference_s)


@dataclass(frozen=True)
class Recommendation:
    best: Estimate | None  # None: nothing fits
    reason: str  # one sentence
    candidates: int  # plans considered


def workload_for(w: AnyWorkload, n_gpus: int) -> AnyWorkload | None:
    """`w` runnable on n ranks: rollout.generate_batch shrunk (to the step's rows // n) when there
    are fewer sampling chunks than ranks; None when the mini-batch itself is too small to share."""
    if isinstance(w, Workload) and w.mini_batch >= n_gpus and w.rank_shares_problem(n_gpus):
        w = replace(w, generate_batch=w.rows // n_gpus)
    return None if w.rank_shares_problem(n_gpus) else w


def candidate_plans(
    w: AnyWorkload, device: DeviceSpec, max_gpus: int, base: Strategy, precisions: BackendPrecisions | None = None
) -> list[tuple[AnyWorkload, Strategy]]:
    """Every runnable plan up to `max_gpus` training GPUs: the torch backend on one device,
    DeepSpeed ZeRO 1-3 x offload x GPU counts (powers of two) whose ranks all get a share of the
    batch, each in its backend's precision (`precisions`; None: all in w.precision). Gradient
    checkpointing and frozen-model offload stay as configured (`base`); a vLLM server on its own
    GPUs gets as many as it needs (vllm_gpus_needed), on top of max_gpus."""

    def adapted(pw: AnyWorkload, stage: int) -> AnyWorkload:
        pw = replace(pw, precision=precisions.for_stage(stage)) if precisions else pw
        return replace(pw, rollout_gpus=vllm_gpus_needed(pw, device)) if pw.rollout_gpus else pw

    plans = [(adapted(w, 0), replace(base, zero_stage=0, n_gpus=1, offload="none"))]
    if w.lora is not None:  # LoRA trains on the torch backend only (engine/config/schema.py)
        return plans
    for stage, offload, n in product((1, 2, 3), OFFLOADS, GPU_COUNTS):
        shared = workload_for(w, n)
        if n > max_gpus or (offload == "all" and stage != 3) or shared is None:
            continue
        plans.append((adapted(shared, stage), replace(base, zero_stage=stage, n_gpus=n, offload=offload)))
    return plans


def recommend(
    w: AnyWorkload,
    device: DeviceSpec,
    currency: str,
    max_gpus: int,
    base: Strategy,
    precisions: BackendPrecisions | None = None,
) -> Recommendation:
    """The cheapest plan (GPU-hours; within COST_TIE the simplest) whose peak fits the device.
    `precisions`: each plan trains in its backend's precision (None: all in w.precision)."""
    plans = candidate_plans(w, device, max_gpus, base, precisions)
    estimates = [estimate_rl(pw, s, device, currency) for pw, s in plans]
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return Recommendation(None, nothing_fits(estimates, device, max_gpus), len(estimates))
    cheapest = min(e.gpu_hours for e in fitting)
    tied = [e for e in fitting if e.gpu_hours <= cheapest * (1 + COST_TIE)]
    best = min(tied, key=lambda e: e.strategy.simplicity_rank)
    return Recommendation(best, recommendation_reason(best, estimates, w), len(estimates))


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:,.1f} MiB"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _states_bytes(w: AnyWorkload) -> float:
    """Weights + gradients + optimizer states of the trained models together, unpartitioned (with
    LoRA: the frozen base weights plus the trainable parameters' states)."""
    states = w.trainable_params * w.precision.model_state_bytes
    if w.lora is not None:
        base = w.actor.lm_params + (w.critic_params if isinstance(w, Workload) else 0)
        states += base * w.precision.weight_bytes
    return states


def _trained_models(w: AnyWorkload) -> str:
    """e.g. "the 7.00B actor and 0.50B critic", "the 0.50B actor (no critic)", "the 7.00B policy",
    "the 7.00B actor (no critic; LoRA: 40.00M trainable)"."""
    lora = f"LoRA: {_params(w.trainable_params)} trainable" if w.lora else ""
    if isinstance(w, DPOWorkload):
        return f"the {_params(w.actor.lm_params)} policy" + (f" ({lora})" if lora else "")
    if w.critic is None:
        return f"the {_params(w.actor.lm_params)} actor (no critic{'; ' + lora if lora else ''})"
    both = f"the {_params(w.actor.lm_params)} actor and {_params(w.critic_params)} critic"
    return both + (f" ({lora})" if lora else "")


def why_not(e: Estimate) -> str:
    """What breaks a plan that does not fit, e.g. "~95.0 GiB/GPU in training > 72.0 GiB usable"."""
    if e.memory.peak.total > e.usable_bytes:
        return f"~{_gib(e.memory.peak.total)}/GPU in {e.memory.peak.phase} > {_gib(e.usable_bytes)} usable"
    if e.memory.cpu_ram_per_node > e.usable_host_bytes:
        return f"~{_gib(e.memory.cpu_ram_per_node)} host RAM per node > {_gib(e.usable_host_bytes)} usable"
    return (
        f"~{_gib(e.memory.rollout_gpu_bytes)} for the vLLM server's weights and one row's KV cache >"
        f" {_gib(e.memory.rollout_gpu_capacity)} on its {e.workload.rollout_gpus} GPU(s)"
    )


def recommendation_reason(best: Estimate, estimates: list[Estimate], w: AnyWorkload) -> str:
    """Why this plan: what the model states need, and the nearest simpler plan that does not fit."""
    bw = best.workload
    states = (
        f"weights+gradients+optimizer of {_trained_models(bw)} need {_gib(_states_bytes(bw))} ({bw.precision.name})"
    )
    if isinstance(bw, Workload) and isinstance(w, Workload) and bw.generate_batch != w.generate_batch:
        states += f", with rollout.generate_batch={bw.generate_batch} so every rank samples a chunk"
    if bw.rollout_gpus != w.rollout_gpus:
        states += f", with the vLLM server on {bw.rollout_gpus} GPUs (tensor_parallel_size={bw.rollout_gpus})"
    rank = best.strategy.simplicity_rank
    simpler = [e for e in estimates if not e.fits and e.strategy.simplicity_rank < rank]
    if not simpler:
        return (
            f"{best.strategy.label}: {states}; its peak is {_gib(best.memory.peak.total)}/GPU"
            f" ({best.memory.peak.phase}) of {_gib(best.usable_bytes)} usable, and it is the cheapest plan that fits"
        )
    closest = max(simpler, key=lambda e: e.strategy.simplicity_rank)
    return f"{best.strategy.label}: {states}; {closest.strategy.label} does not fit ({why_not(closest)})"


def nothing_fits(estimates: list[Estimate], device: DeviceSpec, max_gpus: int) -> str:
    """Which plan came closest, and what dominates its peak: the remedy depends on it."""
    if not estimates:
        return f"no plan can run: the batch has fewer rows or chunks than {max_gpus} ranks need"
    closest = min(estimates, key=lambda e: (e.memory.peak.total, e.memory.cpu_ram_per_node))
    parts = closest.memory.peak.components()
    batch_bound = parts["activations"] + parts["logits"] + parts["kv_cache"]
    states_bound = sum(v for k, v in parts.items() if k.endswith("_weights") or k in ("gradients", "optimizer_states"))
    if closest.memory.peak.total <= closest.usable_bytes:
        fix = "use nodes with more host RAM, or less offload over more GPUs (--max-gpus)"
    elif batch_bound >= states_bound and isinstance(closest.workload, DPOWorkload):
        fix = (
            "shrink the per-pass batch: engine.micro_batch_size=1, engine.gradient_checkpointing=true,"
            " or a smaller dpo.max_seq_tokens"
        )
    elif batch_bound >= states_bound:
        fix = (
            "shrink the per-pass batch: engine.micro_batch_size=1, engine.gradient_checkpointing=true,"
            " a smaller rollout.generate_batch, or shorter prompts/responses"
        )
    elif closest.workload.lora is not None:
        fix = (
            "model.lora trains on one device (the torch backend): a GPU type with more memory or a smaller model;"
            " without model.lora, ZeRO can spread full training over more GPUs"
        )
    else:
        fix = f"allow more GPUs (--max-gpus above {max_gpus}), a GPU type with more memory, or a smaller model"
    return (
        f"nothing fits on {device.name} with up to {max_gpus} GPUs: the closest plan, {closest.strategy.label},"
        f" needs {why_not(closest)}; {fix}"
    )
