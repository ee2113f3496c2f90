"""Device memory of an RL step or of the DPO stage, per GPU, by component and phase (bytes throughout).

Phases are sequential, so the peak is the largest phase, not the sum of everything. RL stage
(every algorithm.name; a critic-free one has no critic states, values or critic activations; no
learned reward model: no reward weights):
- rollout: the actor samples `generate_batch` rows (KV cache) while every resident state waits;
- scoring: actor, reference, critic and reward model(s) run forward passes over a chunk (logits);
- training: actor and critic take turns (fwd + bwd of a micro-batch): gradients and activations.
DPO (estimate_dpo_memory):
- reference: the frozen reference alone scores pass_pairs pairs per forward (the policy loads after);
- training: the policy's states and a micro-batch of 2 x pairs sequences; the reference is freed.

Formulas (e = activation bytes, the weights' dtype; t = tokens in a micro-batch or chunk):
- model states (ZeRO paper, Rajbhandari et al. 2019): weights / gradients / optimizer states per
  parameter from the Precision; stage 1 divides optimizer states by the n ranks, stage 2 also the
  gradients, stage 3 also the weights (of frozen models too: the engine wraps them in ZeRO-3).
- activations per token per layer, stored for backward: e * (4h + 2 q + 2 kv + m I) with q/kv the
  query/key-value widths, I the MLP width and m = 4 for a gated MLP (gate, up, activation, product)
  or 2 (fc1 output, activation). It is Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models", arXiv:2205.05198) eq. 1 re-derived for SDPA/flash attention (no
  stored s x s scores: the 5as/h term is gone) and no dropout (the engine disables it): for GPT
  widths (q = kv = h, I = 4h, m = 2) it gives 32 s b h bytes at e = 2, their 34 minus the 2 dropout
  masks. Gradient checkpointing keeps only each layer's input (e * h per token per layer, their
  "full recomputation" 2sbhL) plus one layer's activations while it is recomputed.
- logits: the LM head runs over chunks of engine/models/lm_head.py CHUNK_TOKENS positions (recomputed in
  the backward), so one chunk's [chunk x vocab] logits are alive at a time: in e bytes, then fp32
  (.float(), / temperature, log_softmax; entropy: exp, product): LOGIT_FP32_COPIES copies of
  [min(positions, chunk) x vocab] x 4 bytes. With chunking off, positions are all rows x response
  tokens. Critic and reward model have a scalar head: no vocab-sized tensor.
- KV cache: 2 * layers * kv_heads * head_dim * e per token, for generate_batch x (prompt + response).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from rlflow.engine.estimate.hardware import DeviceSpec
from rlflow.engine.estimate.model_shape import ModelShape
from rlflow.engine.estimate.workload import AnyWorkload, DPOWorkload, Precision, Strategy, Workload

GIB = 2**30
# fp32 [rows x response x vocab] tensors alive at once in an actor training micro-batch (the upcast
# logits, their /temperature copy, two log_softmax outputs, exp and the entropy product; the
# backward of one of them adds a gradient of that size while the others are freed). Counted from
# engine/models/loading.py token_logprobs + engine/algorithms/stats.py; to be checked against `rlflow probe`.
LOGIT_FP32_COPIES = 6
# Scoring passes need no entropy and keep no autograd graph: the upcast and its log_softmax.
SCORING_LOGIT_FP32_COPIES = 2
# fp32 [sequences x tokens x vocab] tensors alive at once in a DPO training micro-batch
# (engine/stages/dpo.py sequence_logps: logits of every position, not only a response's): the upcast,
# cross_entropy's log_softmax output kept for backward and, in backward, its gradient.
DPO_LOGIT_FP32_COPIES = 3
# CUDA context, cuBLAS/NCCL workspaces and allocator slack that no tensor accounts for, per GPU
# process (a CUDA context alone is 0.3-0.6 GiB on A100/H100), plus caching-allocator
# fragmentation as a share of the tensors.
GPU_FRAMEWORK_GIB = 1.5
GPU_FRAGMENTATION = 0.05
# What a CPU process holds beyond tensors once it runs PPO, above its post-import resident set:
# allocator arenas, oneDNN scratch, generation's code and caches. `rlflow probe` measured 0.10
# GiB on the demo model (0.4M parameters, where nothing else counts); docs/estimate.md.
CPU_FRAMEWORK_GIB = 0.10
# DeepSpeed's default reduce/all-gather bucket (reduce_bucket_size = 5e8 elements) in gradient
# dtype, allocated by ZeRO's optimizer whatever the model size above it.
ZERO_BUCKET_ELEMENTS = 5e8
# A vLLM server takes this share of its GPUs (its default gpu_memory_utilization).
VLLM_MEMORY_SHARE = 0.9
# Host memory of each GPU training process besides offloaded states (its CPU copy of tensors
# while loading, pinned staging buffers, Python).
HOST_PROCESS_GIB = 4.0


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes on one training GPU during one phase, by component."""

    phase: str
    actor_weights: float
    critic_weights: float
    reference_weights: float
    reward_weights: float
    gradients: float
    optimizer_states: float
    zero_gathered: float  # ZeRO-3: parameters gathered for the module running now
    activations: float
    logits: float
    kv_cache: float
    rollout_server: float  # a vLLM server sharing this GPU: its weights and KV cache
    framework_overhead: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "phase")

    def components(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "phase"}


@dataclass(frozen=True)
class MemoryEstimate:
    phases: tuple[PhaseMemory, ...]
    cpu_ram_per_node: float  # bytes of host memory per node: offloaded states + the processes
    rollout_gpu_bytes: float  # a dedicated vLLM GPU's use (weights + KV of its concurrent rows); 0 if none
    rollout_gpu_capacity: float  # bytes the vLLM server may use on its GPUs; 0 if none
    rollout_concurrency: int  # rows the sampler decodes at once

    @property
    def peak(self) -> PhaseMemory:
        return max(self.phases, key=lambda p: p.total)


def activation_bytes_per_token_layer(shape: ModelShape, e: int) -> int:
    """Bytes one token leaves for backward in one layer (see the module docstring)."""
    m = 4 if shape.gated_mlp else 2
    return e * (4 * shape.hidden_size + 2 * shape.q_width + 2 * shape.kv_width + m * shape.intermediate_size)


def training_activation_bytes(shape: ModelShape, tokens: int, e: int, checkpointing: bool) -> float:
    """Activations kept for backward over all layers for `tokens` tokens of a micro-batch."""
    per_layer = activation_bytes_per_token_layer(shape, e) * tokens
    if checkpointing:
        return shape.num_layers * e * shape.hidden_size * tokens + per_layer
    return shape.num_layers * per_layer


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int, e: int) -> float:
    """KV cache of `rows` sequences of `tokens` tokens: 2 * layers * kv_heads * head_dim * e each."""
    return shape.kv_bytes_per_token(e) * rows * tokens


def logit_positions(positions: int) -> int:
    """Positions whose logits are alive at once: one chunk of the LM head (engine/models/lm_head.py)."""
    from rlflow.engine.models import lm_head

    return min(positions, lm_head.CHUNK_TOKENS) if lm_head.CHUNK_TOKENS else positions


def actor_logit_bytes(shape: ModelShape, rows: int, w: Workload, e: int, fp32_copies: int) -> float:
    """Logits of the response positions (the engine asks for no others), one chunk at a time, in e
    bytes + fp32 copies of them."""
    positions = logit_positions(rows * w.response_tokens)
    return positions * shape.vocab_size * (e + fp32_copies * 4)


@dataclass(frozen=True)
class _Resident:
    """Model states per GPU that persist across phases (bytes), and what went to host memory."""

    weights: dict[str, float]
    optimizer: float
    gradients: float  # during training only: freed (set to None) after each optimizer step
    host: float  # per rank


def partitioned_states(params: float, p: Precision, zero_stage: int, n: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per GPU of `params` trainable parameters: ZeRO
    stage 1 partitions the optimizer states over n ranks, 2 also the gradients, 3 also the weights
    (Rajbhandari et al. 2019, Figure 1: 7.5B, n = 64 -> 120 / 31.4 / 16.6 / 1.9 GB total)."""
    return (
        params * p.weight_bytes / (n if zero_stage >= 3 else 1),
        params * p.grad_bytes / (n if zero_stage >= 2 else 1),
        params * p.optimizer_bytes / (n if zero_stage >= 1 else 1),
    )


def resident_states(w: Workload, s: Strategy) -> _Resident:
    """Weights, gradients and optimizer states per GPU under ZeRO stage / offload (see docstring);
    a critic-free workload has no critic, one without learned reward models no reward weights."""
    p, n = w.precision, s.n_gpus
    trainable = w.trainable_params
    lora = w.lora is not None  # the frozen base plus the trainable adapters and copies
    params = {
        "actor": w.actor.lm_params + (w.actor_trainable if lora else 0),
        "critic": w.critic_params + (w.critic_trainable if lora else 0),
        "reference": w.reference_params,
        "reward": sum(r.scalar_params for r in w.rewards),
    }
    weight_share = 1 / n if s.zero_stage == 3 else 1.0
    weights = {name: count * p.weight_bytes * weight_share for name, count in params.items()}
    host = 0.0
    if s.offload_params:  # ZeRO-3 partitions of every model live in host memory
        host += sum(weights.values())
        weights = dict.fromkeys(weights, 0.0)
    _, gradients, optimizer = partitioned_states(trainable, p, s.zero_stage, n)
    if s.zero_stage == 0:  # the torch backend frees each model's gradients at its optimizer step
        gradients = max(w.actor_trainable, w.critic_trainable) * p.grad_bytes
    if s.offload_optimizer:  # ZeRO-Offload: optimizer states and fp32 gradient partitions on the host
        host += optimizer + trainable * 4 / n
        optimizer, gradients = 0.0, 0.0
    return _Resident(weights, optimizer, gradients, host)


def _frozen_away(s: Strategy, on_gpu: bool) -> bool:
    """engine.offload_frozen_models: reference and reward model in host memory outside rollout and
    scoring (a no-op on the CPU and under ZeRO-3, as in Runtime.onloaded)."""
    return s.offload_frozen_models and on_gpu and s.zero_stage != 3


def zero_gathered_bytes(w: AnyWorkload, s: Strategy) -> float:
    """ZeRO-3 gathers each module's parameters before it runs and prefetches the next: about two
    decoder layers plus the vocab matrix of the largest model, whole, in weight dtype."""
    if s.zero_stage != 3 or (s.n_gpus == 1 and not s.offload_params):
        return 0.0
    return max(2 * m.layer_params + m.vocab_size * m.hidden_size for m in w.shapes) * w.precision.weight_bytes


@dataclass(frozen=True)
class RolloutMemory:
    """What sampling holds: on the training GPUs (HF generate, or a vLLM server sharing them) or
    on the vLLM server's own GPUs."""

    kv_on_trainer: float  # HF generate's KV cache on each training rank
    server_on_trainer: float  # a vLLM server without GPUs of its own: its weights + KV cache
    server_gpu_bytes: float  # a vLLM server on dedicated GPUs: weights + KV of its concurrent rows
    server_gpu_capacity: float
    concurrency: int  # rows decoded at once


def rollout_memory(w: Workload, device: DeviceSpec) -> RolloutMemory:
    """KV cache and sampler weights: HF generate keeps generate_batch rows; vLLM keeps as many of the
    batch's rows (prompts x rollout.n) as its KV-cache space holds (all, when it shares the training GPUs)."""
    e = w.precision.weight_bytes
    row_kv = kv_cache_bytes(w.actor, 1, w.sequence_tokens, e)
    if w.rollout_engine == "hf":
        return RolloutMemory(row_kv * w.generate_batch, 0.0, 0.0, 0.0, w.generate_batch)
    weights = w.actor.lm_params * e
    if w.rollout_gpus == 0:
        return RolloutMemory(0.0, weights + row_kv * w.rows, 0.0, 0.0, w.rows)
    capacity = VLLM_MEMORY_SHARE * device.memory_gib * GIB * w.rollout_gpus
    room = capacity - weights - GPU_FRAMEWORK_GIB * GIB * w.rollout_gpus
    concurrency = int(min(w.rows, max(0.0, room) // row_kv))
    used = weights + GPU_FRAMEWORK_GIB * GIB * w.rollout_gpus + row_kv * max(1, concurrency)
    return RolloutMemory(0.0, 0.0, used, capacity, concurrency)


def vllm_gpus_needed(w: Workload, device: DeviceSpec, most: int = 8) -> int:
    """Dedicated vLLM GPUs (tensor parallel, a power of two up to `most`) for `w`: the fewest at or
    above w.rollout_gpus whose KV-cache room holds the whole rollout batch, else the fewest that
    hold the weights and one row, else `most`."""
    counts = [k for k in (1, 2, 4, 8, 16) if max(1, w.rollout_gpus) <= k <= max(most, w.rollout_gpus)]
    options = [(k, rollout_memory(replace(w, rollout_gpus=k), device).concurrency) for k in counts]
    whole = [k for k, rows in options if rows >= w.rows]
    some = [k for k, rows in options if rows >= 1]
    return (whole or some or [counts[-1]])[0]


def _overhead(tensors: float, device: DeviceSpec, buckets: float) -> float:
    if device.is_cpu:
        return CPU_FRAMEWORK_GIB * GIB
    return GPU_FRAMEWORK_GIB * GIB + GPU_FRAGMENTATION * tensors + buckets


def estimate_memory(w: Workload, s: Strategy, device: DeviceSpec) -> MemoryEstimate:
    """Bytes per training GPU in each phase, host memory per node and the sampler's GPUs."""
    on_gpu = not device.is_cpu
    res = resident_states(w, s)
    roll = rollout_memory(w, device)
    e, g = w.precision.weight_bytes, w.generate_batch
    gathered = zero_gathered_bytes(w, s)
    frozen_away = _frozen_away(s, on_gpu)
    weights = res.weights
    w_train = dict(weights, reference=0.0, reward=0.0) if frozen_away else weights
    layer = activation_bytes_per_token_layer(w.actor, e)  # a forward's transient working set: one layer
    rollout_parts = dict(
        activations=layer * g * w.prompt_tokens if w.rollout_engine == "hf" else 0.0,
        logits=g * w.actor.vocab_size * 4.0 if w.rollout_engine == "hf" else 0.0,
        kv_cache=roll.kv_on_trainer,
    )
    scoring_parts = dict(
        activations=layer * g * w.sequence_tokens,
        logits=actor_logit_bytes(w.actor, g, w, e, SCORING_LOGIT_FP32_COPIES),
        kv_cache=0.0,
    )
    rows = w.micro_rows(s.n_gpus)
    tokens = rows * w.sequence_tokens
    actor_act = training_activation_bytes(w.actor, tokens, e, s.gradient_checkpointing)
    actor_logits = actor_logit_bytes(w.actor, rows, w, e, LOGIT_FP32_COPIES)
    critic_act = training_activation_bytes(w.critic, tokens, e, s.gradient_checkpointing) if w.critic else 0.0
    actor_turn = actor_act + actor_logits >= critic_act
    training_parts = dict(
        activations=actor_act if actor_turn else critic_act, logits=actor_logits if actor_turn else 0.0, kv_cache=0.0
    )
    if w.single_pass(s):  # both forwards run before either backward: both graphs are alive
        training_parts.update(activations=actor_act + critic_act, logits=actor_logits)
    buckets = 0.0
    if s.zero_stage >= 1 and on_gpu:
        largest = max(w.actor_trainable, w.critic_trainable)
        buckets = min(ZERO_BUCKET_ELEMENTS, largest) * w.precision.grad_bytes
    shared = dict(optimizer=res.optimizer, gathered=gathered, server=roll.server_on_trainer, device=device)
    phases = (
        _phase("rollout", rollout_parts, weights, grads=0.0, buckets=0.0, **shared),
        _phase("scoring", scoring_parts, weights, grads=0.0, buckets=0.0, **shared),
        _phase("training", training_parts, w_train, grads=res.gradients, buckets=buckets, **shared),
    )
    peak = max(p.total for p in phases)
    frozen = w.frozen_params * w.precision.weight_bytes if frozen_away else 0.0
    return MemoryEstimate(
        phases=phases,
        cpu_ram_per_node=_host_bytes(s, res.host + frozen, device, peak),
        rollout_gpu_bytes=roll.server_gpu_bytes,
        rollout_gpu_capacity=roll.server_gpu_capacity,
        rollout_concurrency=roll.concurrency,
    )


def _phase(
    name: str,
    parts: dict[str, float],
    weights: dict[str, float],
    grads: float,
    optimizer: float,
    gathered: float,
    server: float,
    device: DeviceSpec,
    buckets: float,
) -> PhaseMemory:
    """One phase's PhaseMemory: `weights` by model name (absent: not on the device), `parts` the
    activations, logits and KV cache, the framework overhead on top of all tensors."""
    tensors = sum(weights.values()) + grads + optimizer + gathered + server + sum(parts.values())
    return PhaseMemory(
        phase=name,
        actor_weights=weights.get("actor", 0.0),
        critic_weights=weights.get("critic", 0.0),
        reference_weights=weights.get("reference", 0.0),
        reward_weights=weights.get("reward", 0.0),
        gradients=grads,
        optimizer_states=optimizer,
        zero_gathered=gathered,
        rollout_server=server,
        framework_overhead=_overhead(tensors, device, buckets),
        **parts,
    )


def _host_bytes(s: Strategy, host: float, device: DeviceSpec, peak: float) -> float:
    """Host memory per node: on a CPU machine, the peak itself; on GPU nodes, what each rank moved
    there (offloaded states, frozen models waiting) plus HOST_PROCESS_GIB per rank."""
    if device.is_cpu:
        return peak * s.n_gpus
    ranks = min(s.n_gpus, device.gpus_per_node)
    return ranks * (host + HOST_PROCESS_GIB * GIB)


def dpo_logit_bytes(shape: ModelShape, sequences: int, tokens: int, e: int, fp32_copies: int) -> float:
    """Logits of every position of `sequences` x `tokens`, one chunk at a time, in e bytes + fp32
    copies of them."""
    full = logit_positions(sequences * tokens) * shape.vocab_size
    return full * e + fp32_copies * full * 4.0


def estimate_dpo_memory(w: DPOWorkload, s: Strategy, device: DeviceSpec) -> MemoryEstimate:
    """Bytes per training GPU in DPO's phases (engine/stages/dpo.py): the reference pass holds the frozen
    reference alone (the policy is loaded after it) and a chunk of 2 x pass_pairs sequences;
    training holds the policy's weights, gradients and optimizer states (ZeRO-partitioned as in
    the RL stage) and a micro-batch of 2 x micro_pairs sequences; the reference is freed by then."""
    p, n, e, tokens = w.precision, s.n_gpus, w.precision.weight_bytes, w.seq_tokens
    actor_w, grads, optimizer = partitioned_states(w.trainable_params, p, s.zero_stage, n)
    if w.lora is not None:  # the frozen base besides the trainable adapters (torch backend: one process)
        actor_w += w.actor.lm_params * e
    ref_w = w.reference.lm_params * e / (n if s.zero_stage == 3 else 1)
    host = 0.0
    if s.offload_params:  # ZeRO-3 partitions live in host memory; one model at a time
        host, actor_w, ref_w = max(actor_w, ref_w), 0.0, 0.0
    if s.offload_optimizer:
        host += optimizer + w.trainable_params * 4 / n
        optimizer, grads = 0.0, 0.0
    gathered = zero_gathered_bytes(w, s)
    ref_rows, rows = 2 * w.pass_pairs, 2 * w.micro_pairs(n)
    reference_parts = dict(
        activations=activation_bytes_per_token_layer(w.reference, e) * ref_rows * tokens,
        logits=dpo_logit_bytes(w.reference, ref_rows, tokens, e, SCORING_LOGIT_FP32_COPIES),
        kv_cache=0.0,
    )
    training_parts = dict(
        activations=training_activation_bytes(w.actor, rows * tokens, e, s.gradient_checkpointing),
        logits=dpo_logit_bytes(w.actor, rows, tokens, e, DPO_LOGIT_FP32_COPIES),
        kv_cache=0.0,
    )
    on_gpu = not device.is_cpu
    buckets = min(ZERO_BUCKET_ELEMENTS, w.trainable_params) * p.grad_bytes if s.zero_stage >= 1 and on_gpu else 0.0
    shared = dict(gathered=gathered, server=0.0, device=device)
    phases = (
        _phase("reference", reference_parts, {"reference": ref_w}, grads=0.0, optimizer=0.0, buckets=0.0, **shared),
        _phase("training", training_parts, {"actor": actor_w}, grads, optimizer, buckets=buckets, **shared),
    )
    peak = max(ph.total for ph in phases)
    return MemoryEstimate(phases, _host_bytes(s, host, device, peak), 0.0, 0.0, 0)
