"""Typed run configuration: YAML file + `a.b=c` overrides -> validated, frozen models.

Every section forbids unknown keys; errors name the file, the key path and the offending value
and list the valid keys, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
import math
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from rlflow.engine.config_base import FunctionRef, Section, function_ref
from rlflow.engine.config_methods import AlgorithmConfig, DPOConfig, RewardConfig
from rlflow.engine.config_model import LoraConfig, ModelConfig
from rlflow.engine.config_yaml import locator, parse_yaml, read_text
from rlflow.engine.errors import ConfigError
from rlflow.engine.secrets import REDACTED, is_secret_path, redact_override, redacted_dict

RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RunConfig(Section):
    name: str | None = None  # None: a fresh name is generated for every new run
    seed: int = 0
    rounds: int = Field(2, ge=1, le=1000)
    root: str = "runs"  # fsspec URL holding checkpoints: {root}/{name}/round_{r}/{stage}/step_{n}
    storage_options: dict[str, Any] = Field(default_factory=dict)  # s3fs etc. credentials: secret
    threads: int = Field(2, ge=1, le=512)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str | None) -> str | None:
        if value is not None and not RUN_NAME_PATTERN.match(value):
            raise ValueError(
                f"run.name {value!r} is not safe for a path: use 1-128 letters, digits, '.', '_' or '-'"
                " starting with a letter or digit"
            )
        return value


class DataConfig(Section):
    sft: str = "demo_assets/data/sft.jsonl"
    sft_eval: str = "demo_assets/data/sft_eval.jsonl"
    preferences: str | None = "demo_assets/data/preferences.jsonl"  # None: online labels (label.*) only
    preferences_eval: str | None = "demo_assets/data/preferences_eval.jsonl"  # clean gold labels
    prompts: str = "demo_assets/data/prompts.jsonl"
    eval_prompts: str = "demo_assets/data/eval_prompts.jsonl"
    storage_options: dict[str, Any] = Field(default_factory=dict)
    max_prompt_tokens: int = Field(64, ge=1)
    prompt_overflow: Literal["truncate", "drop"] = "truncate"
    # auto: prompts (and SFT pairs) go through the tokenizer's chat template, an error if it has
    # none; none: the text as written (base models, the demo's tiny model).
    chat_template: Literal["auto", "none"] = "auto"


class SFTConfig(Section):
    rounds: list[int] = Field(default_factory=lambda: [0])  # rounds that start with SFT
    max_steps: int = Field(400, ge=1)
    batch_size: int = Field(32, ge=1)  # sequences per optimizer step, over all ranks and micro-batches
    lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_seq_tokens: int = Field(128, ge=8)
    eval_every: int = Field(25, ge=1)
    patience: int = Field(3, ge=1)  # held-out evals without a 1% improvement before stopping
    log_every: int = Field(10, ge=1)


class RewardModelConfig(Section):
    init: str = "sft"  # "sft": the round's SFT checkpoint; otherwise a model path
    epochs: int = Field(2, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_seq_tokens: int = Field(128, ge=8)
    norm_samples: int = Field(256, ge=2)  # fixed reference set for score mean/std
    log_every: int = Field(10, ge=1)


class KLConfig(Section):
    controller: Literal["fixed", "adaptive"] = "adaptive"
    init_coef: float = Field(0.05, ge=0)
    target: float = Field(0.05, gt=0)  # token-mean KL the adaptive controller aims at
    horizon: int = Field(2000, ge=1)
    estimator: Literal["k1", "k2", "k3", "abs"] = "k1"  # per-token penalty in the reward


class PPOConfig(Section):
    steps: int = Field(40, ge=1)
    rollout_batch: int = Field(64, ge=1)  # prompts per PPO step
    mini_batch: int = Field(32, ge=1)
    epochs: int = Field(2, ge=1)
    actor_lr: float = Field(5e-4, gt=0)
    critic_lr: float = Field(1e-3, gt=0)
    clip_ratio: float = Field(0.2, gt=0)
    value_clip: float = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    kl: KLConfig = Field(default_factory=KLConfig)
    reference: Literal["sft", "round_start"] = "sft"
    critic_init: Literal["rm", "policy"] = "rm"
    critic_warmup_steps: int = Field(0, ge=0)
    whiten_advantages: bool = True
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    stop_kl: float | None = Field(0.3, gt=0)  # end the round's PPO once rollout KL passes this
    max_grad_norm: float = Field(1.0, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(24, ge=1)
    log_every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _whole_mini_batches(self) -> PPOConfig:
        # Each mini-batch gets its own optimizer step with a loss normalised within it, so a short
        # last mini-batch (rollout_batch % mini_batch rows) would weigh its rows double and take a
        # noisier step; mini_batch > rollout_batch would silently shrink to rollout_batch. Both
        # change training without saying so, hence a rule (as in verl): mini-batches tile the batch.
        if self.rollout_batch % self.mini_batch:
            n, m = self.rollout_batch, self.mini_batch
            # The largest divisor not above mini_batch (its memory stays within what was asked), found
            # in bounded time: huge values fall back to the gcd, a common divisor too.
            below = range(min(n, m), max(0, min(n, m) - 100_000), -1)
            closest = next((d for d in below if n % d == 0), math.gcd(n, m))
            raise ValueError(
                f"ppo.rollout_batch={self.rollout_batch} is not a multiple of ppo.mini_batch={self.mini_batch}:"
                " every mini-batch is one optimizer step, so all must be the same size; set ppo.mini_batch to a"
                f" divisor of ppo.rollout_batch (e.g. {closest}) or ppo.rollout_batch to a multiple of"
                f" ppo.mini_batch (e.g. {-(-self.rollout_batch // self.mini_batch) * self.mini_batch})"
            )
        return self


class EvalConfig(Section):
    every_steps: int = Field(10, ge=1)  # during PPO
    num_prompts: int = Field(256, ge=1)
    batch_size: int = Field(128, ge=1)
    num_logged_samples: int = Field(12, ge=0)
    # PPO's evaluations every `every_steps` on the first this many of num_prompts; None: all.
    curve_prompts: int | None = Field(None, ge=1)
    greedy: bool = False  # greedy decoding in every evaluation (how verifiable-task accuracy is reported)

    def sampling(self, ppo: PPOConfig) -> Any:
        """The SamplingParams evaluations use: PPO's, or greedy with PPO's max_new_tokens."""
        from rlflow.engine.rollout import SamplingParams

        temperature, top_p = (0.0, 1.0) if self.greedy else (ppo.temperature, ppo.top_p)
        return SamplingParams(temperature, top_p, ppo.max_new_tokens)


class LabelConfig(Section):
    labeller: FunctionRef = Field(
        default_factory=lambda: FunctionRef(fn="rlflow.engine.demo_task:noisy_gold_labeller", kwargs={"noise": 0.1})
    )
    online_from_round: int | None = Field(1, ge=0)  # None: offline preferences only; 0: pairs of the SFT policy
    prompts_per_round: int = Field(512, ge=1)
    eval_fraction: float = Field(0.0, ge=0, lt=1)  # labelled pairs held out of RM training: rm/accuracy_online
    # Human labels (fsspec prefix): `rlflow label import` writes <inbox>/<run>/round_<n>.jsonl
    # there; round r's reward model also trains on those of rounds < r. Watched by the
    # label-inbox deployment, whose event starts the next round (prefect.yaml).
    human_inbox: str | None = None


class CheckpointConfig(Section):
    every_steps: int = Field(10, ge=1)
    keep_last: int = Field(2, ge=1)
    # Every n-th checkpoint (and a stage's last) also holds whole HF model directories; the others
    # hold only per-rank optimizer shards with fp32 master weights (a 70B policy is 140 GB each time).
    consolidate_every: int = Field(5, ge=1)
    keep_best: str | None = None  # e.g. "eval/rm_score": the best evaluated step is never pruned
    keep_best_mode: Literal["max", "min"] = "max"  # "min" for losses and KL
    # A second copy of every committed step (any fsspec URL), written in the background.
    mirror: str | None = None
    mirror_storage_options: dict[str, Any] = Field(default_factory=dict)  # the mirror's credentials: secret
    mirror_retries: int = Field(8, ge=0)  # retries of each file copy before the step is tried again later
    mirror_backoff_s: float = Field(1.0, gt=0)  # first retry delay in seconds; doubles up to 60 s
    # SIGTERM (spot reclaim, pod eviction): checkpoint at the next step boundary within this time.
    preempt_grace_s: float = Field(120.0, gt=0)


class ResumeConfig(Section):
    # Continue a stage whose identity changed (config, inputs or data); the changed keys become
    # MLflow tags. Off: a changed finished stage is an error.
    allow_config_change: bool = False


class StagePolicy(Section):
    """How Prefect runs a stage: retries (each resumes from the last checkpoint) and the watchdog."""

    retries: int | None = Field(None, ge=0)
    retry_delay_s: float | None = Field(None, ge=0)
    hang_timeout_s: float | None = Field(None, gt=0)  # no step finished for this long: stacks dumped, stage failed


class StageConfig(Section):
    retries: int = Field(0, ge=0)
    retry_delay_s: float = Field(10.0, ge=0)
    hang_timeout_s: float | None = Field(3600.0, gt=0)  # None: no watchdog (training stages: sft, rm, ppo)
    # Per-stage overrides, e.g. stage.ppo.retries=3; unset fields inherit the values above.
    sft: StagePolicy = Field(default_factory=StagePolicy)
    label: StagePolicy = Field(default_factory=StagePolicy)
    rm: StagePolicy = Field(default_factory=StagePolicy)
    ppo: StagePolicy = Field(default_factory=StagePolicy)
    dpo: StagePolicy = Field(default_factory=StagePolicy)
    eval: StagePolicy = Field(default_factory=StagePolicy)

    def policy(self, stage: str) -> StagePolicy:
        """The effective retries, retry delay and hang timeout of one stage."""
        override: StagePolicy = getattr(self, stage)
        pick = lambda name: getattr(self, name) if getattr(override, name) is None else getattr(override, name)
        return StagePolicy(**{name: pick(name) for name in StagePolicy.model_fields})


class SafetyConfig(Section):
    """Guards while training."""

    max_nonfinite_skips: int = Field(3, ge=0)  # consecutive skipped non-finite updates before the stage stops
    max_kl: float | None = Field(None, gt=0)  # PPO circuit breaker on the rollout KL to the reference
    kl_patience: int = Field(3, ge=1)  # consecutive steps above max_kl that trip it
    # How long a paused run (KL breach, reward failure) waits for an operator before it fails.
    pause_timeout_s: float = Field(86400.0, gt=0)


class AlertsConfig(Section):
    webhook_url: str | None = None  # JSON POST on a KL breach or reward failure: secret (may hold a token)
    headers: dict[str, str] = Field(default_factory=dict)  # e.g. Authorization: secret
    timeout_s: float = Field(10.0, gt=0)


class TrackingConfig(Section):
    uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///{root}/mlflow.db
    experiment: str = "rlflow"


class EngineConfig(Section):
    """How every stage trains: one process (torch) or a DeepSpeed ZeRO job, and how batches are cut."""

    backend: Literal["torch", "deepspeed"] = "torch"
    zero_stage: Literal[1, 2, 3] = 2  # deepspeed only
    offload_optimizer: bool = False  # ZeRO optimizer state in CPU memory
    offload_params: bool = False  # ZeRO-3 parameters in CPU memory
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    micro_batch_size: int | None = Field(None, ge=1)  # rows per forward pass per rank; None: all at once
    # Padding-free dynamic batching: micro-batches hold at most this many real tokens per rank.
    max_tokens_per_microbatch: int | None = Field(None, ge=8)
    # SFT and reward model: concatenate a micro-batch's sequences into one row (no padding at all).
    packing: bool = False
    gradient_checkpointing: bool = False
    offload_frozen_models: bool = False  # reference and reward models wait in CPU memory between phases

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"engine.offload_params needs engine.zero_stage=3 (got {self.zero_stage})")
        return self


class ResourcesConfig(Section):
    """Where a stage runs: processes per node and nodes (deepspeed backend only above one process)."""

    nproc_per_node: int = Field(1, ge=1, le=64)
    nnodes: int = Field(1, ge=1, le=1024)
    node_rank: int = Field(0, ge=0)  # this machine's rank when each node runs its own launcher
    hostfile: str | None = None  # DeepSpeed/MPI style "host slots=N" lines (launcher deepspeed)
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(None, ge=1, le=65535)  # None: a free port
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    # The accelerator type, a device name of configs/prices.yaml (e.g. a100-80g); read only by
    # `rlflow estimate` (None: this machine's CPU). Not part of any stage's identity.
    gpu_type: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class RolloutConfig(Section):
    """Where responses are sampled, and how the sampler's weights are kept in step with training."""

    mode: Literal["colocated", "server"] = "colocated"
    server_backend: Literal["hf", "vllm"] = "hf"
    generate_batch: int = Field(32, ge=1)  # sequences sampled together under one seed (world-size independent)
    n: int = Field(1, ge=1, le=1024)  # samples per prompt (a group: GRPO and RLOO need n >= 2)
    bucket_mb: float = Field(256.0, gt=0)  # weight-sync bucket size (MB)
    check_fingerprint: bool = True
    probe_rows: int = Field(4, ge=1)  # worker samples whose log-probs the trainer recomputes after a sync
    max_logprob_diff: float = Field(1e-3, gt=0)  # nats per token; above it the run stops
    vllm_python: str = ".venv-vllm/bin/python"  # interpreter of the separate vLLM environment
    startup_timeout_s: float = Field(300.0, gt=0)


class PlacementConfig(Section):
    """GPU indices per role; None everywhere: all roles colocated on all visible GPUs."""

    train: list[int] | None = None
    rollout: list[int] | None = None


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    label: LabelConfig = Field(default_factory=LabelConfig)
    gold: FunctionRef = Field(default_factory=lambda: FunctionRef(fn="rlflow.engine.demo_task:gold_score"))
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    resume: ResumeConfig = Field(default_factory=ResumeConfig)
    stage: StageConfig = Field(default_factory=StageConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    # "package.module:function"s called with every logged step (engine/progress.py StepEvent);
    # a returned {name: number} is logged as extra metrics of that step.
    callbacks: list[str] = Field(default_factory=list)

    @field_validator("callbacks")
    @classmethod
    def _function_refs(cls, refs: list[str]) -> list[str]:
        return [function_ref(ref) for ref in refs]

    @model_validator(mode="after")
    def _lora_needs_torch_backend(self) -> Config:
        if self.model.lora is not None and self.engine.backend != "torch":
            raise ValueError(
                f"model.lora needs engine.backend=torch for now (got {self.engine.backend}): LoRA adapters under"
                " DeepSpeed ZeRO are not supported yet; set engine.backend=torch or remove model.lora"
            )
        if self.model.lora is not None and self.rollout.mode == "server" and self.rollout.server_backend == "vllm":
            raise ValueError(
                "model.lora with rollout.server_backend=vllm is not supported yet: vLLM cannot load a LoRA"
                " checkpoint directory; use rollout.server_backend=hf or rollout.mode=colocated, or remove model.lora"
            )
        return self

    @model_validator(mode="after")
    def _one_process_unless_deepspeed(self) -> Config:
        if self.resources.world_size > 1 and self.engine.backend != "deepspeed":
            raise ValueError(
                f"resources.nproc_per_node={self.resources.nproc_per_node} x resources.nnodes={self.resources.nnodes}"
                " needs engine.backend=deepspeed (the torch backend runs one process)"
            )
        algorithm, n = self.algorithm.name, self.rollout.n
        if algorithm in ("grpo", "rloo") and n < 2:
            raise ValueError(
                f"algorithm.name={algorithm} compares the samples of one prompt with each other: it needs"
                f" rollout.n >= 2 samples per prompt (got {n}); e.g. rollout.n=4"
            )
        if algorithm in ("ppo",) and self.ppo.critic_init == "rm" and not self.reward.learned:
            raise ValueError(
                "ppo.critic_init=rm starts the critic from the round's reward model, but reward.sources has no"
                " model source without a path (so no reward model is trained); set ppo.critic_init=policy or a"
                " critic-free algorithm.name (grpo, rloo, reinforce_pp)"
            )
        world = self.resources.world_size
        # Every rank needs rows in every pass (ZeRO's collectives run in each forward and backward).
        shares = {
            "ppo.rollout_batch x rollout.n / rollout.generate_batch chunks": -(
                -self.ppo.rollout_batch * n // self.rollout.generate_batch
            ),
            "eval.num_prompts / eval.batch_size chunks": -(-self.eval.num_prompts // self.eval.batch_size),
            "ppo.mini_batch": self.ppo.mini_batch,
            "sft.batch_size": self.sft.batch_size,
            "rm.batch_size": self.rm.batch_size,
        }
        for what, n in shares.items():
            if n < world:
                raise ValueError(
                    f"{what} = {n} is less than the {world} ranks (resources): every rank needs a share;"
                    f" make it at least {world} or use fewer ranks"
                )
        return self


def _section_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in path:
        if isinstance(part, int):  # an item of a list of sections (reward.sources)
            continue
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        members = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
        if len(members) == 1 and isinstance(annotation, types.UnionType):  # an optional section (model.lora)
            annotation = members[0]
        if getattr(annotation, "__origin__", None) is list:
            annotation = annotation.__args__[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _show_value(value: Any) -> str:
    """repr of a bad value, cut short: a pasted 10 000-item list must not flood the one line."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:100]}... ({len(text)} characters)"


def _key_text(loc: tuple[Any, ...]) -> str:
    """A key path as typed; a key holding a newline or other control character is shown escaped."""
    key = ".".join(str(p) for p in loc)
    return key if key.isprintable() else repr(key)[1:-1]


def _format_error(error: dict[str, Any], source: str) -> str:
    loc = tuple(error["loc"])
    key = _key_text(loc)
    if error["type"] == "extra_forbidden":
        section = _section_at(loc[:-1])
        valid = ", ".join(sorted(section.model_fields)) if section else "?"
        where = _key_text(loc[:-1]) or "top level"
        return f"{source}: unknown key '{key}' in {where}; valid keys: {valid}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error" and isinstance(error.get("input"), dict):
        return f"{source}: {message}"  # a check across keys of a section: its message names them
    # A mistyped credential is still a credential: the message names the key, not the value.
    shown = REDACTED if is_secret_path(loc) else _show_value(error.get("input"))
    return f"{source}: invalid value for '{key}': {shown} ({message})"


def _shown_override(text: str) -> str:
    return repr(redact_override(text))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], c) with c parsed as a YAML scalar/list/dict."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"override {_shown_override(text)} must look like key.path=value, e.g. ppo.steps=20")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: a date like 2024-13-45
        raise ConfigError(
            f"override {_shown_override(text)}: value is not valid YAML ({exc.__class__.__name__});"
            " quote it, e.g. key='value'"
        ) from None
    return key.strip().split("."), value


def apply_override(tree: dict[str, Any], text: str) -> None:
    path, value = parse_override(text)
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"override {_shown_override(text)}: '{'.'.join(path[: i + 1])}' is not a section;"
                " override one of its keys only when it is a mapping"
            )
        node = child
    node[path[-1]] = value


def build_config(tree: dict[str, Any], source: str, locate: Callable[[tuple[Any, ...]], str] | None = None) -> Config:
    """Validate a config tree; `locate` turns an error's key path into "file:line" for messages."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ConfigError(_format_error(error, locate(tuple(error["loc"])) if locate else source)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config file and apply `a.b=c` overrides; raise ConfigError naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = read_text(path)
    tree = parse_yaml(path, text)
    if tree is None:  # an empty file: every default
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    tree = copy.deepcopy(tree)
    for override in overrides:
        apply_override(tree, override)
    source = f"{path}" + (" (with overrides)" if overrides else "")
    return build_config(tree, source, locator(path, text, overrides))


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(redacted_dict(config), sort_keys=False)
