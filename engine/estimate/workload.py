"""What a training stage does (Workload: the RL stage; DPOWorkload: DPO) and how it is spread
over devices (Strategy), for the estimate.

The RL stage mirrors engine/stages/rl/step.py for every algorithm.name: per step, `rollout_batch` prompts x
`rollout.n` samples (consecutive rows) are sampled in chunks of `generate_batch` rows (chunk c on
rank c % n), scored chunk by chunk (actor and reference log-probs, critic values unless the
algorithm is critic-free, the learned reward models), then `epochs` passes of actor (and critic)
updates over mini-batches of `mini_batch` prompts x n rows, each rank training on its share cut
into micro-batches. DPO mirrors engine/stages/dpo.py: the reference's log-probs of every pair once,
then optimizer steps over `batch_size` pairs; no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate.model_shape import LoraShape, ModelShape


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


# The RL stage's algorithms (engine/config/methods.py ALGORITHMS but DPO), as the report names them.
RL_ALGORITHMS = {"ppo": "PPO", "grpo": "GRPO", "rloo": "RLOO", "reinforce_pp": "REINFORCE++"}


@dataclass(frozen=True)
class Workload:
    """One RL stage: actor, reference, critic (None: critic-free), the learned reward models
    (none: rules and functions alone), batch geometry (a row is one sample: prompts x rollout.n;
    tokens per row) and steps."""

    actor: ModelShape
    critic: ModelShape | None  # None: a critic-free algorithm (GRPO, RLOO, REINFORCE++) loads no critic
    reference: ModelShape
    reward: ModelShape | None  # the round's reward model; None: no reward.sources model without a path
    rollout_batch: int  # prompts per step (rl.rollout_batch)
    prompt_tokens: int  # longest prompt (data.max_prompt_tokens): every row is padded to it
    response_tokens: int  # sampling.max_new_tokens: an upper bound, a batch decodes until its longest row ends
    mini_batch: int  # prompts per optimizer step (rl.mini_batch); rows: x samples_per_prompt
    epochs: int  # rl.epochs
    steps: int  # rl.steps
    generate_batch: int  # rows sampled and scored together per rank (rollout.generate_batch)
    precision: Precision
    micro_batch_size: int | None = None  # engine.micro_batch_size (rows); None: a rank's whole mini-batch share
    max_tokens_per_microbatch: int | None = None
    rollout_engine: str = "hf"  # a ROLLOUT_ENGINES name; "vllm" = rollout.mode server with vLLM
    rollout_gpus: int = 0  # GPUs only the vLLM server uses (placement.rollout minus placement.train)
    # rollout.async or off_policy_steps > 0: with rollout_gpus, the server samples beside training
    overlap: bool = False
    algorithm: str = "ppo"  # a key of RL_ALGORITHMS (algorithm.name)
    samples_per_prompt: int = 1  # rollout.n
    extra_rewards: tuple[ModelShape, ...] = ()  # reward.sources models with a path: frozen scalar models
    kl_in_loss: bool = False  # the KL is a loss term (GRPO's default): no extra pass, said in the report
    lora: LoraShape | None = None  # model.lora for the RL stage: actor and critic train adapters
    reference_shared: bool = False  # LoRA: the reference is the actor with its adapters off (no copy)

    def __post_init__(self) -> None:
        if self.reference_shared and self.lora is None:
            raise ConfigError("reference_shared needs lora: only a LoRA actor computes its reference with adapters off")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"unknown rollout engine {self.rollout_engine!r}; valid: {', '.join(ROLLOUT_ENGINES)}")
        if self.algorithm not in RL_ALGORITHMS:
            raise ConfigError(f"unknown RL algorithm {self.algorithm!r}; valid: {', '.join(RL_ALGORITHMS)}")

    @property
    def rows(self) -> int:
        """Samples per step: rollout_batch prompts x samples_per_prompt (what is sampled, scored, trained)."""
        return self.rollout_batch * self.samples_per_prompt

    @property
    def mini_rows(self) -> int:
        """Rows per optimizer step: mini_batch prompts x samples_per_prompt."""
        return self.mini_batch * self.samples_per_prompt

    @property
    def rewards(self) -> tuple[ModelShape, ...]:
        """Every learned reward model that scores each chunk: the round's, then those given by path."""
        return ((self.reward,) if self.reward is not None else ()) + self.extra_rewards

    @property
    def critic_params(self) -> int:
        return 0 if self.critic is None else self.critic.scalar_params

    @property
    def actor_trainable(self) -> int:
        """The actor's parameters with gradients and optimizer states (with LoRA: adapters etc.)."""
        return self.lora.trainable(self.actor, scalar=False) if self.lora else self.actor.lm_params

    @property
    def critic_trainable(self) -> int:
        if self.critic is None:
            return 0
        return self.lora.trainable(self.critic, scalar=True) if self.lora else self.critic.scalar_params

    @property
    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer states: the actor, plus the critic if there is one."""
        return self.actor_trainable + self.critic_trainable

    @property
    def reference_params(self) -> int:
        """The reference's own weights: none when it is the LoRA actor with its adapters off."""
        return 0 if self.reference_shared else self.reference.lm_params

    @property
    def frozen_params(self) -> int:
        """Parameters of the frozen models: the reference and every learned reward model."""
        return self.reference_params + sum(r.scalar_params for r in self.rewards)

    @property
    def shapes(self) -> tuple[ModelShape, ...]:
        """Every model the stage loads."""
        return (self.actor, self.reference) + ((self.critic,) if self.critic else ()) + self.rewards

    @property
    def sequence_tokens(self) -> int:
        """Tokens of one row, prompt + response (rows keep the batch's padded width)."""
        return self.prompt_tokens + self.response_tokens

    @property
    def algorithm_name(self) -> str:
        """PPO, GRPO, RLOO or REINFORCE++."""
        return RL_ALGORITHMS[self.algorithm]

    @property
    def label(self) -> str:
        """e.g. "GRPO: 16 prompts x 4 samples = 64 rows per step, no critic, KL in the loss"."""
        n = self.samples_per_prompt
        rows = f"{self.rollout_batch} prompts x {n} samples = {self.rows} rows" if n > 1 else f"{self.rows} prompts"
        parts = [f"{self.algorithm_name}: {rows} per step", "a critic" if self.critic else "no critic"]
        parts.append("KL in the loss" if self.kl_in_loss else "KL in the reward")
        if not self.rewards:
            parts.append("no reward model (rule/function rewards run in CPU workers)")
        elif self.extra_rewards:
            parts.append(f"{len(self.rewards)} reward model(s)")
        return ", ".join(parts)

    def rows_per_rank(self, n_gpus: int) -> int:
        """Rows of one mini-batch that one rank trains on."""
        return -(-self.mini_rows // n_gpus)

    def micro_rows(self, n_gpus: int) -> int:
        """Rows per training micro-batch on one rank (engine.micro_batch_size / max_tokens_per_microbatch)."""
        rows = self.rows_per_rank(n_gpus)
        if self.micro_batch_size is not None:
            rows = min(rows, self.micro_batch_size)
        if self.max_tokens_per_microbatch is not None:
            rows = min(rows, max(1, self.max_tokens_per_microbatch // self.sequence_tokens))
        return rows

    def single_pass(self, s: Strategy) -> bool:
        """Whether the engine skips the old-log-prob and value passes (engine/stages/rl/step.py
        single_pass_possible): one process, one epoch over one mini-batch in one micro-batch."""
        one_update = self.epochs == 1 and self.mini_batch == self.rollout_batch
        one_micro = self.max_tokens_per_microbatch is None and self.micro_rows(1) == self.rows
        return s.zero_stage == 0 and s.n_gpus == 1 and self.rollout_engine == "hf" and one_update and one_micro

    @property
    def chunks(self) -> int:
        """Sampling-and-scoring chunks of generate_batch rows per step."""
        return -(-self.rows // self.generate_batch)

    def chunks_per_rank(self, n_gpus: int) -> int:
        """Sampling-and-scoring chunks (generate_batch rows each) one rank handles per step."""
        return -(-self.chunks // n_gpus)

    def rank_shares_problem(self, n_gpus: int) -> str | None:
        """Why `n_gpus` ranks cannot run this batch (the config's every-rank-needs-a-share rule), or None."""
        if self.mini_batch < n_gpus:
            return f"rl.mini_batch={self.mini_batch} is below {n_gpus} ranks"
        if self.chunks < n_gpus:
            return (
                f"{self.chunks} rollout chunks (rl.rollout_batch x rollout.n / rollout.generate_batch) are fewer"
                f" than {n_gpus} ranks"
            )
        return None


@dataclass(frozen=True)
class DPOWorkload:
    """The DPO stage (engine/stages/dpo.py): a frozen reference scores every pair once (chosen and rejected,
    `pass_pairs` pairs per forward), then `epochs` x ceil(pairs / batch_size) optimizer steps of the
    policy over `batch_size` pairs; each pair is two sequences padded to the longer, at most
    `seq_tokens` tokens. No sampling, no critic, no reward model."""

    actor: ModelShape  # the policy
    reference: ModelShape
    pairs: int  # preference pairs trained on (per epoch)
    batch_size: int  # pairs per optimizer step (dpo.batch_size)
    epochs: int  # dpo.epochs
    seq_tokens: int  # dpo.max_seq_tokens: every sequence counted at this padded width (an upper bound)
    precision: Precision
    held_out_pairs: int = 0  # data.preferences_eval pairs: the reference pass scores them too
    micro_batch_size: int | None = None  # engine.micro_batch_size, in pairs
    max_tokens_per_microbatch: int | None = None
    algorithm: str = "dpo"
    rollout_gpus: int = 0  # no sampler: a vLLM server never runs in DPO
    lora: LoraShape | None = None  # model.lora for the DPO stage

    @property
    def steps(self) -> int:
        """Optimizer steps of the stage: epochs x ceil(pairs / batch_size)."""
        return self.epochs * -(-self.pairs // self.batch_size)

    @property
    def trainable_params(self) -> int:
        return self.lora.trainable(self.actor, scalar=False) if self.lora else self.actor.lm_params

    @property
    def shapes(self) -> tuple[ModelShape, ...]:
        return self.actor, self.reference

    @property
    def pass_pairs(self) -> int:
        """Pairs per reference forward (engine/stages/dpo.py pass_pairs): at most a training micro-batch."""
        n = min(self.micro_batch_size or self.batch_size, self.batch_size)
        if self.max_tokens_per_microbatch is not None:
            n = min(n, max(1, self.max_tokens_per_microbatch // (2 * self.seq_tokens)))
        return n

    def pairs_per_rank(self, n_gpus: int) -> int:
        """Pairs of one optimizer step that one rank trains on."""
        return -(-self.batch_size // n_gpus)

    def micro_pairs(self, n_gpus: int) -> int:
        """Pairs per training micro-batch on one rank (a pair is 2 x seq_tokens padded tokens)."""
        pairs = self.pairs_per_rank(n_gpus)
        if self.micro_batch_size is not None:
            pairs = min(pairs, self.micro_batch_size)
        if self.max_tokens_per_microbatch is not None:
            pairs = min(pairs, max(1, self.max_tokens_per_microbatch // (2 * self.seq_tokens)))
        return pairs

    def reference_chunks_per_rank(self, n_gpus: int) -> int:
        """Reference forwards (pass_pairs pairs each) one rank runs, over training and held-out pairs."""
        return -(-(-(-(self.pairs + self.held_out_pairs) // self.pass_pairs)) // n_gpus)

    @property
    def algorithm_name(self) -> str:
        return "DPO"

    @property
    def label(self) -> str:
        """e.g. "DPO: 1000 pairs x 1 epoch(s) = 32 step(s) of 32 pairs, reference pass once over 1000
        pairs, no generation"."""
        return (
            f"DPO: {self.pairs} pairs x {self.epochs} epoch(s) = {self.steps} step(s) of {self.batch_size} pairs,"
            f" reference pass once over {self.pairs + self.held_out_pairs} pairs, no generation"
        )

    def rank_shares_problem(self, n_gpus: int) -> str | None:
        """Why `n_gpus` ranks cannot share a step's pairs, or None."""
        if self.batch_size < n_gpus:
            return f"dpo.batch_size={self.batch_size} is below {n_gpus} ranks"
        return None


AnyWorkload = Workload | DPOWorkload
