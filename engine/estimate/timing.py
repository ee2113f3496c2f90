"""Seconds per RL step (PPO, GRPO, RLOO, REINFORCE++) or DPO step, by phase, from FLOPs, bytes
moved and a few calibrated efficiencies.

Each compute phase is a roofline: max(FLOPs / (peak * MFU), bytes read / (bandwidth * efficiency)),
plus a host-side overhead per forward call (eager PyTorch dispatches every op from Python: it
dominates small models). FLOPs follow Kaplan et al. 2020 / Narayanan et al. 2021: a forward is
2 * (matmul parameters) per token plus causal attention 2 * layers * q_width * s^2 per row; a
training step is 3 forwards' worth (forward + backward), 4 with gradient checkpointing (the
recomputed forward). Decoding is bandwidth-bound: every generated token step reads all actor weights
once for the whole batch plus each row's KV cache so far. Collectives move (n-1)/n of their bytes
per rank at the node's bus bandwidth; the engine runs ZeRO-3 with overlap_comm off, so they do not
hide behind compute.

Per algorithm: rows are prompts x rollout.n everywhere; a critic-free algorithm has no values
pass and no critic update; without a learned reward model there is no reward forward (rules and
functions run in CPU worker processes, overlapping sampling: no GPU time). DPO: the reference's
forward over every pair once (StepTime is then per optimizer step, the pass a one-off), then
forward + backward of the policy over 2 x batch_size sequences per step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlflow.engine.estimate.hardware import DeviceSpec
from rlflow.engine.estimate.memory import MemoryEstimate
from rlflow.engine.estimate.model_shape import LoraShape, ModelShape
from rlflow.engine.estimate.workload import DPOWorkload, Precision, Strategy, Workload


@dataclass(frozen=True)
class Efficiency:
    """Achieved shares of a device's peaks."""

    train_mfu: float  # model FLOPs utilisation of forward + backward
    forward_mfu: float  # of inference forwards (prefill, scoring): no backward, larger batches
    bandwidth: float  # share of memory bandwidth that streaming kernels (optimizer, weight reads) reach
    forward_overhead_s: float  # host time per forward call outside the layers (embedding, masks, HF wrappers)
    layer_overhead_s: float  # host time per layer per forward call (op dispatch)


# GPU: 40% MFU is what DeepSpeed ZeRO training of 1-70B decoders typically reports on A100/H100
# (Megatron-LM reaches 50%+ with tensor parallelism and fused kernels; HF models without them
# less); inference forwards run larger, backward-free GEMMs. CPU: shares of the rate *measured* by
# a 2048^3 matmul, not of a datasheet peak. The demo's PPO steps (runs/demo3: 2 cores) ran their
# forwards at the calibration's rate and their training passes at ~90% of it (docs/estimate.md):
# on two cores both are compute-bound, the narrow demo GEMMs no slower than the large one.
# Overheads: eager PyTorch dispatch on a GPU host, ~1 ms per call and 0.3 ms per layer; on the
# 2-core CPU `rlflow probe` measured ~10 ms per forward of the 2-layer demo model whose FLOPs take
# well under 1 ms (a scoring pass of 32 rows: 9.6 ms; a training micro-batch: 31 ms = 3 calls).
EFFICIENCY: dict[str, Efficiency] = {
    "gpu": Efficiency(
        train_mfu=0.40, forward_mfu=0.50, bandwidth=0.7, forward_overhead_s=1.0e-3, layer_overhead_s=0.3e-3
    ),
    "cpu": Efficiency(
        train_mfu=0.90, forward_mfu=1.00, bandwidth=0.7, forward_overhead_s=4.0e-3, layer_overhead_s=3.0e-3
    ),
}


@dataclass(frozen=True)
class DecodeEngine:
    """How a rollout engine decodes."""

    bandwidth_efficiency: float  # share of memory bandwidth its decode kernels reach
    kv_traffic: float  # KV-cache bytes moved per byte of cache per token step
    step_overhead_s: float  # host time per token step (sampling, scheduling, cache bookkeeping)
    layer_overhead_s: float  # host time per layer per token step (op dispatch)


# hf: HF generate in eager mode. Its DynamicCache grows each layer's K/V by torch.cat, which reads
# the old cache and writes the new one (3x the cache bytes per step, not 1x); every op is
# dispatched from Python (~30 ops per layer at ~10 us each), plus logits processing and sampling
# per step (~1 ms for the demo's 32 rows on a CPU core); with these the demo's 2-layer model takes
# ~3.5 ms per decode step where it measured 2.9 ms (runs/demo3): its 3 MB cache stays in CPU cache.
# vllm: paged KV cache read once per step, CUDA graphs (no per-layer dispatch), ~1.5 ms scheduler
# and sampler time per step; its decode GEMV/attention kernels reach ~80% of HBM bandwidth at
# large batch (vLLM's published decode throughput is close to the bandwidth roofline). Both are
# judgments to be replaced by measured `rlflow probe` numbers.
DECODE_ENGINES: dict[str, DecodeEngine] = {
    "hf": DecodeEngine(bandwidth_efficiency=0.6, kv_traffic=3.0, step_overhead_s=1.0e-3, layer_overhead_s=0.3e-3),
    "vllm": DecodeEngine(bandwidth_efficiency=0.8, kv_traffic=1.0, step_overhead_s=1.5e-3, layer_overhead_s=0.0),
}
# A backward's host overhead, in forwards' (Efficiency.forward_overhead_s / layer_overhead_s).
BACKWARD_OVERHEAD = 2.0
# Adam step traffic: reads master/param, gradient, m, v and writes them back, ~28 bytes per
# parameter in one fused pass: the torch backend's fused AdamW (engine/backend/optim.py; 0.033 s
# for 50M parameters on this CPU). DeepSpeed steps its partitions with the per-tensor loop, ~3
# passes (mul, addcmul, sqrt/div...).
ADAM_BYTES_PER_PARAM = 28
ADAM_PASSES = {"fused": 1, "per-tensor": 3}
# Host memory bandwidth one rank's offloaded Adam gets (torch AdamW on the CPU: the engine keeps
# zero_force_ds_cpu_optimizer off, so no vectorised DeepSpeed CPUAdam); nodes share their RAM bus.
HOST_ADAM_GBS = 10.0


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, by phase: one after another, or with generation beside the rest
    (`overlapped`: the sampler on GPUs of its own samples the next batch while this one trains)."""

    generation: float  # prefill + decoding of the rollout batch (0 for DPO)
    scoring: float  # old log-probs, reference log-probs, values, reward scores (0 for DPO)
    training: float  # actor (and critic) forward + backward, all epochs; DPO: the policy's
    optimizer: float  # Adam steps (on the host when offloaded)
    communication: float  # ZeRO collectives, offload copies, weight sync to a vLLM server
    overlapped: bool = False

    @property
    def sequential(self) -> float:
        """The step with no overlap (synchronous sampling)."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "overlapped")

    @property
    def total(self) -> float:
        """Overlapped, the slower side bounds the step: the sampler's generation or the trainer's
        scoring, training, optimizer and communication (a steady state with a full buffer)."""
        if not self.overlapped:
            return self.sequential
        return max(self.generation, self.sequential - self.generation)


def forward_flops(flop_params: int, shape: ModelShape, rows: int, tokens: int) -> float:
    """FLOPs of one forward over `rows` x `tokens`: 2 per matmul parameter per token + causal attention."""
    return 2.0 * flop_params * rows * tokens + 2.0 * shape.num_layers * shape.q_width * tokens**2 * rows


def sequence_flops(shape: ModelShape, flop_params: int, rows: int, tokens: int, logit_tokens: int) -> float:
    """forward_flops of a model whose vocabulary head (if `flop_params` counts one) runs on only
    `logit_tokens` positions per row: the engine asks for the response positions' logits alone
    (logits_to_keep), generate's prefill for the last position's."""
    head = shape.vocab_size * shape.hidden_size if flop_params == shape.lm_flop_params else 0
    return forward_flops(flop_params - head, shape, rows, tokens) + 2.0 * head * rows * logit_tokens


def collective_s(nbytes: float, n: int, device: DeviceSpec) -> float:
    """A ring all-gather / reduce-scatter of `nbytes` (the full tensor) over n ranks."""
    return 0.0 if n <= 1 else nbytes * (n - 1) / n / (device.collective_gbs(n) * 1e9)


def _forward_overhead(shape: ModelShape, eff: Efficiency) -> float:
    return eff.forward_overhead_s + shape.num_layers * eff.layer_overhead_s


def generation_seconds(w: Workload, s: Strategy, device: DeviceSpec, mem: MemoryEstimate) -> tuple[float, float]:
    """(compute, communication) seconds of sampling one step's rows (prompts x rollout.n)."""
    engine, eff = DECODE_ENGINES[w.rollout_engine], EFFICIENCY["cpu" if device.is_cpu else "gpu"]
    e, a = w.precision.weight_bytes, w.actor
    weights = a.lm_params * e
    if w.rollout_engine == "hf":
        rows, units, gpus = w.generate_batch, w.chunks_per_rank(s.n_gpus), 1
    else:
        rows = max(1, mem.rollout_concurrency)
        units, gpus = -(-w.rows // rows), max(1, w.rollout_gpus)
    peak, bandwidth = device.peak_flops(w.precision.compute) * gpus, device.memory_gbs * 1e9 * gpus
    prefill = max(
        sequence_flops(a, a.lm_flop_params, rows, w.prompt_tokens, 1) / (peak * eff.forward_mfu),
        weights / (bandwidth * eff.bandwidth),
    )
    context = w.prompt_tokens + (w.response_tokens + 1) / 2  # mean KV length over the decode steps
    step_bytes = weights + engine.kv_traffic * rows * context * a.kv_bytes_per_token(e)
    step_flops = 2.0 * a.lm_flop_params * rows + 4.0 * a.num_layers * a.q_width * context * rows
    step = max(step_bytes / (bandwidth * engine.bandwidth_efficiency), step_flops / (peak * eff.forward_mfu))
    step += engine.step_overhead_s + engine.layer_overhead_s * a.num_layers
    compute = units * (prefill + w.response_tokens * step)
    comm = 0.0
    if w.rollout_engine == "hf" and s.zero_stage == 3:  # every forward (prefill, each token) gathers the actor
        per_forward = collective_s(weights, s.n_gpus, device)
        per_forward += weights / s.n_gpus / (device.pcie_gbs * 1e9) if s.offload_params else 0.0
        comm = units * (1 + w.response_tokens) * per_forward
    if w.rollout_engine == "vllm":  # new actor weights to the server each step, through host memory
        comm = 2 * weights / (device.pcie_gbs * 1e9)
    return compute, comm


def _scoring_models(w: Workload, s: Strategy) -> tuple[tuple[ModelShape, int, int], ...]:
    """(shape, FLOP parameters, parameters) of the scoring forwards: the reference and each learned
    reward model, plus the actor's old log-probs and the critic's values (if there is a critic)
    unless the update computes them."""
    frozen = ((w.reference, w.reference.lm_flop_params, w.reference.lm_params),)
    frozen += tuple((r, r.scalar_flop_params, r.scalar_params) for r in w.rewards)
    if w.single_pass(s):
        return frozen
    own = ((w.actor, w.actor.lm_flop_params, w.actor.lm_params),)
    if w.critic is not None:
        own += ((w.critic, w.critic.scalar_flop_params, w.critic.scalar_params),)
    return frozen + own


def scoring_seconds(w: Workload, s: Strategy, device: DeviceSpec) -> tuple[float, float]:
    """(compute, communication) seconds of the scoring forwards over one rank's chunks."""
    eff, e = EFFICIENCY["cpu" if device.is_cpu else "gpu"], w.precision.weight_bytes
    peak, bandwidth = device.peak_flops(w.precision.compute), device.memory_gbs * 1e9
    chunks = w.chunks_per_rank(s.n_gpus)
    compute = comm = 0.0
    for shape, flop_params, params in _scoring_models(w, s):
        flops = sequence_flops(shape, flop_params, w.generate_batch, w.sequence_tokens, w.response_tokens + 1)
        per_chunk = max(flops / (peak * eff.forward_mfu), params * e / (bandwidth * eff.bandwidth))
        compute += chunks * (per_chunk + _forward_overhead(shape, eff))
        if s.zero_stage == 3:
            gather = collective_s(params * e, s.n_gpus, device)
            gather += params * e / s.n_gpus / (device.pcie_gbs * 1e9) if s.offload_params else 0.0
            comm += chunks * gather
    if s.offload_frozen_models and not device.is_cpu and s.zero_stage != 3:  # onload, then back to the host
        comm += 2 * w.frozen_params * e / (device.pcie_gbs * 1e9)
    return compute, comm


def _micro_batches_per_epoch(w: Workload, n: int) -> tuple[int, int]:
    """(optimizer steps, micro-batches per rank) in one epoch over the step's rows."""
    mini_batches = w.rollout_batch // w.mini_batch
    return mini_batches, mini_batches * -(-w.rows_per_rank(n) // w.micro_rows(n))


def training_seconds(w: Workload, s: Strategy, device: DeviceSpec) -> tuple[float, float, float]:
    """(forward + backward, optimizer, communication) seconds of all epochs of actor and (if there
    is one) critic updates."""
    n = s.n_gpus
    steps, micro = _micro_batches_per_epoch(w, n)
    rows = steps * w.rows_per_rank(n)
    models = [(w.actor, w.actor.lm_flop_params, w.actor_trainable, False)]
    if w.critic is not None:
        models.append((w.critic, w.critic.scalar_flop_params, w.critic_trainable, True))
    compute = optimizer = comm = 0.0
    for shape, flop_params, params, scalar in models:
        flops = sequence_flops(shape, flop_params, rows, w.sequence_tokens, w.response_tokens + 1)
        grads = weight_grad_share(w.lora, shape, scalar, flop_params)
        parts = update_seconds(shape, flops, params, w.precision, s, device, steps, micro, grads)
        compute, optimizer, comm = compute + parts[0], optimizer + parts[1], comm + parts[2]
    return w.epochs * compute, w.epochs * optimizer, w.epochs * comm


def weight_grad_share(lora: LoraShape | None, shape: ModelShape, scalar: bool, flop_params: int) -> float:
    """Share of a model's matmul weights whose gradient the backward computes: all of them without
    LoRA; with it only what trains whole (modules_to_save), as the adapters' own are negligible."""
    return 1.0 if lora is None else lora.weight_grad_flop_params(shape, scalar) / flop_params


def update_seconds(
    shape: ModelShape,
    forward: float,
    params: int,
    p: Precision,
    s: Strategy,
    device: DeviceSpec,
    steps: int,
    micro: int,
    weight_grads: float = 1.0,
) -> tuple[float, float, float]:
    """(forward + backward, optimizer, communication) seconds of training one model for `steps`
    optimizer steps in `micro` micro-batches per rank, whose forwards take `forward` FLOPs in all.
    `params`: the trained parameters (optimizer, gradients); `weight_grads`: weight_grad_share."""
    eff = EFFICIENCY["cpu" if device.is_cpu else "gpu"]
    peak, bandwidth = device.peak_flops(p.compute), device.memory_gbs * 1e9
    # forward + backward: the input gradients (1 forward) and the weight gradients (1 forward x the
    # share that trains) [+ the recomputed forward with gradient checkpointing]
    passes = 2.0 + weight_grads + (1.0 if s.gradient_checkpointing else 0.0)
    overhead_calls = 1 + BACKWARD_OVERHEAD + (1 if s.gradient_checkpointing else 0)
    compute = passes * forward / (peak * eff.train_mfu) + micro * overhead_calls * _forward_overhead(shape, eff)
    partition = params / (s.n_gpus if s.zero_stage >= 1 else 1)
    adam_gbs = HOST_ADAM_GBS * 1e9 if s.offload_optimizer else bandwidth * eff.bandwidth
    adam_passes = ADAM_PASSES["fused" if s.zero_stage == 0 else "per-tensor"]
    optimizer = steps * partition * ADAM_BYTES_PER_PARAM * adam_passes / adam_gbs
    comm = _training_comm(params, p.weight_bytes, p.grad_bytes, s, device, steps, micro)
    return compute, optimizer, comm


def _training_comm(params: int, wb: int, gb: int, s: Strategy, device: DeviceSpec, steps: int, micro: int) -> float:
    """ZeRO collectives and offload copies of one model over one epoch (ZeRO paper, section 7)."""
    n, weights, grads = s.n_gpus, params * wb, params * gb
    if s.zero_stage == 3:  # gather before forward and backward, reduce-scatter gradients, per micro-batch
        seconds = micro * (2 * collective_s(weights, n, device) + collective_s(grads, n, device))
    elif s.zero_stage == 2:  # gradients reduce-scattered per micro-batch, weights all-gathered per step
        seconds = micro * collective_s(grads, n, device) + steps * collective_s(weights, n, device)
    else:  # stage 1 (and the one-process torch backend: n = 1, nothing moves)
        seconds = steps * (collective_s(grads, n, device) + collective_s(weights, n, device))
    pcie = device.pcie_gbs * 1e9
    if s.offload_params:  # each rank fetches its partition for forward and backward
        seconds += micro * 2 * weights / n / pcie
    if s.offload_optimizer:  # gradient partition down, updated weights up, every optimizer step
        seconds += steps * (grads + weights) / n / pcie
    return seconds


def estimate_step_time(w: Workload, s: Strategy, device: DeviceSpec, mem: MemoryEstimate) -> StepTime:
    """Seconds of one RL step on `device` under `s` (mem gives the sampler's concurrency)."""
    generation, generation_comm = generation_seconds(w, s, device, mem)
    scoring, scoring_comm = scoring_seconds(w, s, device)
    training, optimizer, training_comm = training_seconds(w, s, device)
    comm = generation_comm + scoring_comm + training_comm
    return StepTime(generation, scoring, training, optimizer, comm, overlapped=w.overlap and w.rollout_gpus > 0)


def dpo_reference_seconds(w: DPOWorkload, s: Strategy, device: DeviceSpec) -> float:
    """Seconds of the reference's one pass over every pair (training and held-out) on one rank:
    chunks of 2 x pass_pairs sequences, logits at every position (engine/stages/dpo.py all_pair_logps),
    ZeRO-3 gathers per chunk."""
    eff, e, ref = EFFICIENCY["cpu" if device.is_cpu else "gpu"], w.precision.weight_bytes, w.reference
    peak, bandwidth = device.peak_flops(w.precision.compute), device.memory_gbs * 1e9
    chunks, rows = w.reference_chunks_per_rank(s.n_gpus), 2 * w.pass_pairs
    flops = sequence_flops(ref, ref.lm_flop_params, rows, w.seq_tokens, w.seq_tokens)
    per_chunk = max(flops / (peak * eff.forward_mfu), ref.lm_params * e / (bandwidth * eff.bandwidth))
    seconds = chunks * (per_chunk + _forward_overhead(ref, eff))
    if s.zero_stage == 3:
        gather = collective_s(ref.lm_params * e, s.n_gpus, device)
        gather += ref.lm_params * e / s.n_gpus / (device.pcie_gbs * 1e9) if s.offload_params else 0.0
        seconds += chunks * gather
    return seconds


def estimate_dpo_step_time(w: DPOWorkload, s: Strategy, device: DeviceSpec) -> tuple[StepTime, float]:
    """(seconds of one DPO optimizer step, seconds of the one-off reference pass): each rank trains
    on 2 x ceil(batch_size / n) sequences of seq_tokens, logits at every position."""
    n, a = s.n_gpus, w.actor
    pairs = w.pairs_per_rank(n)
    micro = -(-pairs // w.micro_pairs(n))
    forward = sequence_flops(a, a.lm_flop_params, 2 * pairs, w.seq_tokens, w.seq_tokens)
    grads = weight_grad_share(w.lora, a, False, a.lm_flop_params)
    training, optimizer, comm = update_seconds(a, forward, w.trainable_params, w.precision, s, device, 1, micro, grads)
    return StepTime(0.0, 0.0, training, optimizer, comm), dpo_reference_seconds(w, s, device)
