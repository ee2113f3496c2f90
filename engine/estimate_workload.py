"""What a PPO run does (Workload) and how it is spread over devices (Strategy), for the estimate.

Both mirror how the engine runs PPO (engine/ppo.py): per step, `rollout_batch` prompts are
sampled in chunks of `generate_batch` (chunk c on rank c % n), scored by four models (actor,
reference, critic, reward model) chunk by chunk, then `epochs` passes of actor and critic updates
over mini-batches, each rank training on its share cut into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate_model import ModelShape


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and the dtype matmuls run in."""

    name: str
    weight_bytes: int  # weights as held on the device (frozen models too); also activations
    grad_bytes: int
    optimizer_bytes: int  # Adam's two moments, plus an fp32 master copy under mixed precision
    compute: str  # "bf16" or "fp32": which peak rate applies

    @property
    def model_state_bytes(self) -> int:
        """Weights + gradients + optimizer states per trainable parameter (ZeRO paper: 16 for mixed)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


PRECISIONS: dict[str, Precision] = {
    # fp32 weights are their own master copy: Adam adds m and v (4 + 4 bytes).
    "fp32": Precision("fp32", 4, 4, 8, "fp32"),
    # DeepSpeed bf16: bf16 weights and gradients, fp32 master + m + v in the optimizer (the ZeRO
    # paper's K = 12, 2 + 2 + 12 = 16 bytes per parameter).
    "bf16-mixed": Precision("bf16-mixed", 2, 2, 12, "bf16"),
    # The torch backend with model.dtype bfloat16/float16: torch's AdamW keeps m and v in the
    # parameter's dtype and there is no master copy.
    "bf16": Precision("bf16", 2, 2, 4, "bf16"),
}


def precision_named(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def resolve_precision(backend: str, precision: str, model_dtype: str, on_gpu: bool) -> Precision:
    """What the engine would train in: DeepSpeed follows engine.precision ("auto": bf16 on a GPU,
    fp32 on the CPU); the torch backend ignores it and trains in model.dtype."""
    if backend == "deepspeed":
        bf16 = precision == "bf16" or (precision == "auto" and on_gpu)
        return PRECISIONS["bf16-mixed" if bf16 else "fp32"]
    return PRECISIONS["fp32" if model_dtype == "float32" else "bf16"]


@dataclass(frozen=True)
class BackendPrecisions:
    """What each backend would train in for one config: the torch backend (ZeRO stage 0) follows
    model.dtype, DeepSpeed follows engine.precision; a plan search needs both."""

    torch: Precision
    deepspeed: Precision

    @classmethod
    def of(cls, precision: str, model_dtype: str, on_gpu: bool) -> BackendPrecisions:
        return cls(
            torch=resolve_precision("torch", precision, model_dtype, on_gpu),
            deepspeed=resolve_precision("deepspeed", precision, model_dtype, on_gpu),
        )

    def for_stage(self, zero_stage: int) -> Precision:
        return self.torch if zero_stage == 0 else self.deepspeed


# engine.offload_optimizer / engine.offload_params, by the CLI's --offload name.
OFFLOADS: dict[str, tuple[bool, bool]] = {"none": (False, False), "optimizer": (True, False), "all": (True, True)}


@dataclass(frozen=True)
class Strategy:
    """How training is spread: zero_stage 0 is the torch backend (one process, nothing
    partitioned); 1-3 are DeepSpeed ZeRO stages over `n_gpus` data-parallel ranks."""

    zero_stage: int
    n_gpus: int
    offload: str = "none"  # a key of OFFLOADS
    gradient_checkpointing: bool = False
    offload_frozen_models: bool = False  # reference and reward model wait in host memory during updates

    def __post_init__(self) -> None:
        if self.offload not in OFFLOADS:
            raise ConfigError(f"unknown offload {self.offload!r} (--offload); valid: {', '.join(OFFLOADS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 0 (torch backend), 1, 2 or 3 (--zero); got {self.zero_stage}")
        if self.zero_stage == 0 and (self.n_gpus > 1 or self.offload != "none"):
            raise ConfigError(
                "--zero 0 is the torch backend: one process, no offload; use --zero 1/2/3 for more GPUs or offload"
            )
        if self.offload == "all" and self.zero_stage != 3:
            raise ConfigError("--offload all (engine.offload_params) needs ZeRO stage 3 (--zero 3)")
        if self.n_gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {self.n_gpus}")

    @property
    def offload_optimizer(self) -> bool:
        return OFFLOADS[self.offload][0]

    @property
    def offload_params(self) -> bool:
        return OFFLOADS[self.offload][1]

    @property
    def simplicity_rank(self) -> tuple[int, int, int]:
        """Lower is simpler to run: fewer GPUs, a lower ZeRO stage, less offload."""
        return self.n_gpus, self.zero_stage, list(OFFLOADS).index(self.offload)

    @property
    def label(self) -> str:
        """e.g. "ZeRO-3 over 8 GPUs, optimizer offload" or "torch backend on 1 GPU"."""
        where = f"over {self.n_gpus} GPU{'s' if self.n_gpus > 1 else ''}"
        base = "torch backend on 1 device" if self.zero_stage == 0 else f"ZeRO-{self.zero_stage} {where}"
        extra = {"none": "", "optimizer": ", optimizer offload", "all": ", optimizer+parameter offload"}
        return base + extra[self.offload] + (", gradient checkpointing" if self.gradient_checkpointing else "")


# Rollout engines: colocated HF generate on the training ranks, or a vLLM server process.
ROLLOUT_ENGINES = ("hf", "vllm")


@dataclass(frozen=True)
class Workload:
    """One PPO stage: four models, batch geometry (rows = prompts; tokens per row), steps."""

    actor: ModelShape
    critic: ModelShape
    reference: ModelShape
    reward: ModelShape
    rollout_batch: int  # prompts per PPO step (ppo.rollout_batch)
    prompt_tokens: int  # longest prompt (data.max_prompt_tokens): every row is padded to it
    response_tokens: int  # ppo.max_new_tokens: an upper bound, a batch decodes until its longest row ends
    mini_batch: int  # rows per optimizer step (ppo.mini_batch)
    epochs: int  # ppo.epochs
    steps: int  # ppo.steps
    generate_batch: int  # rows sampled and scored together per rank (rollout.generate_batch)
    precision: Precision
    micro_batch_size: int | None = None  # engine.micro_batch_size; None: a rank's whole mini-batch share
    max_tokens_per_microbatch: int | None = None
    rollout_engine: str = "hf"  # a ROLLOUT_ENGINES name; "vllm" = rollout.mode server with vLLM
    rollout_gpus: int = 0  # GPUs only the vLLM server uses (placement.rollout minus placement.train)

    def __post_init__(self) -> None:
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"unknown rollout engine {self.rollout_engine!r}; valid: {', '.join(ROLLOUT_ENGINES)}")

    @property
    def sequence_tokens(self) -> int:
        """Tokens of one row, prompt + response (rows keep the batch's padded width)."""
        return self.prompt_tokens + self.response_tokens

    def rows_per_rank(self, n_gpus: int) -> int:
        """Rows of one mini-batch that one rank trains on."""
        return -(-self.mini_batch // n_gpus)

    def micro_rows(self, n_gpus: int) -> int:
        """Rows per training micro-batch on one rank (engine.micro_batch_size / max_tokens_per_microbatch)."""
        rows = self.rows_per_rank(n_gpus)
        if self.micro_batch_size is not None:
            rows = min(rows, self.micro_batch_size)
        if self.max_tokens_per_microbatch is not None:
            rows = min(rows, max(1, self.max_tokens_per_microbatch // self.sequence_tokens))
        return rows

    def single_pass(self, s: Strategy) -> bool:
        """Whether the engine skips the old-log-prob and value passes (engine/ppo.py
        single_pass_possible): one process, one epoch over one mini-batch in one micro-batch."""
        one_update = self.epochs == 1 and self.mini_batch == self.rollout_batch
        one_micro = self.max_tokens_per_microbatch is None and self.micro_rows(1) == self.rollout_batch
        return s.zero_stage == 0 and s.n_gpus == 1 and self.rollout_engine == "hf" and one_update and one_micro

    def chunks_per_rank(self, n_gpus: int) -> int:
        """Sampling-and-scoring chunks (generate_batch rows each) one rank handles per PPO step."""
        return -(-(-(-self.rollout_batch // self.generate_batch)) // n_gpus)

    def rank_shares_problem(self, n_gpus: int) -> str | None:
        """Why `n_gpus` ranks cannot run this batch (the config's every-rank-needs-a-share rule), or None."""
        chunks = -(-self.rollout_batch // self.generate_batch)
        if self.mini_batch < n_gpus:
            return f"ppo.mini_batch={self.mini_batch} is below {n_gpus} ranks"
        if chunks < n_gpus:
            return f"{chunks} rollout chunks (ppo.rollout_batch / rollout.generate_batch) are fewer than {n_gpus} ranks"
        return None
