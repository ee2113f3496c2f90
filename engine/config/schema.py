"""Typed run configuration: YAML file + `a.b=c` overrides -> validated, frozen models.

Every section forbids unknown keys; errors name the file, the key path and the offending value
and list the valid keys, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from rlflow.engine.config.base import FunctionRef, Section, by_content, function_ref
from rlflow.engine.config.env import EnvConfig
from rlflow.engine.config.promotion import PromotionConfig
from rlflow.engine.config.hacking import HackingConfig
from rlflow.engine.config.execution import (
    AlertsConfig,
    CheckpointConfig,
    EngineConfig,
    PlacementConfig,
    ResourcesConfig,
    ResumeConfig,
    RolloutConfig,
    SafetyConfig,
    StageConfig,
    TrackingConfig,
)
from rlflow.engine.config.kl import KLConfig
from rlflow.engine.config.methods import AlgorithmConfig, DPOConfig, RewardConfig
from rlflow.engine.config.model import ModelConfig
from rlflow.engine.config.moved import moved_key_message
from rlflow.engine.config.sampling import SamplingConfig
from rlflow.engine.config.secrets import REDACTED, is_secret_path, redact_override, redacted_dict
from rlflow.engine.config.stages import EvalConfig, LabelConfig, PPOConfig, RewardModelConfig, RLConfig, SFTConfig
from rlflow.engine.config.yaml_io import locator, parse_yaml, read_text
from rlflow.engine.errors import ConfigError

RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RunConfig(Section):
    name: str | None = None
    """The run's name (1-128 letters, digits, '.', '_' or '-', starting with a letter or digit); running
    the same name again continues that run. None: a fresh name for every new run."""
    seed: int = 0
    """Seed of every random number generator (each derived from it per round, stage and step)."""
    rounds: int = Field(2, ge=1, le=1000)
    """Number of rounds; each runs SFT (in sft.rounds), online labels, the reward model, RL or DPO, and
    an evaluation, as configured."""
    root: str = "runs"
    """fsspec URL holding checkpoints (a folder, s3://...): {root}/{name}/round_{r}/{stage}/step_{n}."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options of run.root, e.g. s3fs credentials."""
    threads: int = Field(2, ge=1, le=512)
    """torch CPU threads per process; $OMP_NUM_THREADS, when set, takes precedence."""

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
    sft: Annotated[str, by_content("file")] = "demo_assets/data/sft.jsonl"
    """SFT rows (`prompt` + `response`, or chat `messages`: every assistant turn is learned, see
    sft.assistant_turns): a JSONL, CSV or Parquet file or URL. Any `prompt` may be a conversation
    (docs/environments.md#conversations)."""
    sft_eval: Annotated[str, by_content("file")] = "demo_assets/data/sft_eval.jsonl"
    """Held-out SFT rows: SFT's eval loss (and early stopping, sft.patience)."""
    preferences: Annotated[str | None, by_content("file")] = "demo_assets/data/preferences.jsonl"
    """Preference pairs (`prompt`, `chosen`, `rejected`; or `chosen` and `rejected` as two whole
    conversations) the reward model (or DPO) trains on; None: online labels (label.*) only, measured
    with label.eval_fraction."""
    preferences_eval: Annotated[str | None, by_content("file")] = "demo_assets/data/preferences_eval.jsonl"
    """Held-out pairs with clean gold labels: the reward model's rm/accuracy (DPO's held-out pairs too);
    None: none."""
    prompts: Annotated[str, by_content("file")] = "demo_assets/data/prompts.jsonl"
    """Prompts of the RL stage and of online labelling (`prompt`: a string or the conversation so far;
    other columns reach the score functions)."""
    eval_prompts: Annotated[str, by_content("file")] = "demo_assets/data/eval_prompts.jsonl"
    """Prompts of the evaluations (during PPO and at each round's end)."""
    regression: Annotated[str | None, by_content("file")] = None
    """A fixed set of prompt/response records (the data.sft format, e.g. data.sft_eval or a capability
    set) on which each round's evaluation measures the start's and the candidate's NLL per response
    token: eval/regression_nll, and the promotion gates' regression_nll_increase; None: not measured."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options (e.g. credentials) for reading the data files."""
    max_prompt_tokens: int = Field(64, ge=1)
    """Prompt token limit of the RL stage, labelling and evaluation; with an `env`, of each episode's
    first messages, the tool instructions included."""
    prompt_overflow: Literal["truncate", "drop"] = "truncate"
    """A longer prompt: truncate (keep its last max_prompt_tokens tokens) or drop; the counts are logged."""
    chat_template: Literal["auto", "none"] = "auto"
    """auto: prompts (and SFT pairs) go through the tokenizer's chat template, an error if it has
    none; none: the text as written (base models, the demo's tiny model)."""


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """The run: its name, seed and number of rounds, and where its checkpoints go."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The initial policy, how models load, and LoRA adapters."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The data files (any fsspec URL; JSONL, CSV or Parquet) and how prompts are cut."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Supervised fine-tuning, in the rounds of sft.rounds."""
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """The round's reward model (Bradley-Terry on preference pairs)."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Which method trains the policy each round."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """The RL stage (PPO, GRPO, RLOO, REINFORCE++): steps, batches, the actor's learning rate and clipping."""
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    """What only PPO (algorithm.name=ppo) has: its critic and GAE."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """The RL stage's KL to its reference: where it acts, its estimator and coefficient, and its limits."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How the policy is sampled by rollouts, online labelling and evaluation."""
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    """Direct Preference Optimisation, the round's training stage with algorithm.name=dpo."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation during PPO and at each round's end."""
    label: LabelConfig = Field(default_factory=LabelConfig)
    """Online preference labels of the policy's own answers, and human labels."""
    gold: FunctionRef = Field(default_factory=lambda: FunctionRef(fn="rlflow.engine.tasksets.demo:gold_score"))
    """Gold score function (evaluation only): `fn(prompt, response, **fields, **kwargs)` returns a number or
    {"score": ..., other numeric components}."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint frequency, pruning, consolidation and the mirror."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Where MLflow records the run."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """How every stage trains: one process (torch) or a DeepSpeed ZeRO job, and how batches are cut."""
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    """The distributed job of a training stage: processes per node, nodes and the launcher."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Where responses are sampled, and how the sampler's weights are kept in step with training."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """GPU indices per role; None everywhere: all roles colocated on all visible GPUs."""
    resume: ResumeConfig = Field(default_factory=ResumeConfig)
    """Continuing a stage whose identity changed."""
    stage: StageConfig = Field(default_factory=StageConfig)
    """How Prefect runs each stage: retries (each resumes from the last checkpoint) and the watchdog."""
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    """Guards while training."""
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    """A webhook called on a KL breach or a reward failure."""
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    """Gates a round's final policy must pass to be the champion the next round starts from."""
    hacking: HackingConfig = Field(default_factory=HackingConfig)
    """The reward-hacking detector of the RL stage: stop and roll back on a divergence (docs/hacking.md)."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """What the RL stage's reward is made of, and what happens when a source fails."""
    env: EnvConfig | None = None
    """The environment each RL prompt becomes an episode of (multi-turn, tool use; docs/environments.md);
    its final answer is what the reward sources score. None: single-turn, one response per prompt."""
    callbacks: list[str] = Field(default_factory=list)
    """The "package.module:function"s called with every logged step (engine/telemetry/progress.py StepEvent);
    a returned {name: number} is logged as extra metrics of that step."""

    @field_validator("callbacks")
    @classmethod
    def _function_refs(cls, refs: list[str]) -> list[str]:
        return [function_ref(ref) for ref in refs]

    @model_validator(mode="after")
    def _env_fits(self) -> Config:
        if self.env is None:
            return self
        refusals = [
            (self.algorithm.name == "dpo", "algorithm.name=dpo trains on preference pairs, not episodes; use an RL"
            " algorithm (ppo, grpo, rloo, reinforce_pp) or remove env"),
            (self.rollout.mode == "server", "env with rollout.mode=server is not supported yet (so neither are"
            " rollout.off_policy_steps and rollout.async): episodes run in the trainer's process; set"
            " rollout.mode=colocated"),
            (self.engine.backend == "deepspeed" and self.engine.zero_stage == 3, "env with engine.zero_stage=3 is not"
            " supported yet (ZeRO-3's sampling runs every rank in lockstep); use zero_stage 1 or 2"),
            (self.rl.loss_agg == "seq-mean-token-sum-norm", "rl.loss_agg=seq-mean-token-sum-norm divides by"
            " sampling.max_new_tokens, one response's budget; an env episode has several turns: use another"
            " rl.loss_agg or remove env"),
            (self.reward.overlong_buffer is not None, "reward.overlong_buffer ramps over one response's"
            " sampling.max_new_tokens; an env episode has several turns: remove reward.overlong_buffer or env"),
            (self.reward.learned and self.label.online_from_round is not None
             and self.label.online_from_round < self.run.rounds, "env with online labels (label.online_from_round="
             f"{self.label.online_from_round}) is not supported yet: the label stage samples single-turn answers, not"
             " episodes, for the reward model to learn; set label.online_from_round=null (offline preferences) or"
             " use rule or function rewards"),
            (self.data.chat_template == "none", "env needs the tokenizer's chat template to write the turns"
            " (data.chat_template=none); set data.chat_template=auto"),
        ]
        for refused, message in refusals:
            if refused:
                raise ValueError(message)
        return self

    @model_validator(mode="after")
    def _hacking_fits(self) -> Config:
        h = self.hacking
        if not h.enabled:
            return self
        checks = [
            self.reward.judge is not None and h.min_judge_drop is not None,
            self.reward.valid is not None and h.max_valid_drop is not None,
            h.max_spread_ratio is not None and self.rm.ensemble > 1 and self.reward.learned,
        ]
        if not any(checks):
            raise ValueError(
                "hacking.enabled has nothing to watch: name a judge (reward.judge, with hacking.min_judge_drop), a"
                " valid rule (reward.valid, with hacking.max_valid_drop) or, with rm.ensemble >= 2, set"
                " hacking.max_spread_ratio"
            )
        if self.checkpoint.every_steps > h.window:
            raise ValueError(
                f"hacking.window={h.window} is shorter than checkpoint.every_steps={self.checkpoint.every_steps}: a"
                " round that diverges falls back to the last checkpoint before the diverged window, so one must"
                f" precede every window; set checkpoint.every_steps to at most {h.window}"
            )
        if self.algorithm.name == "dpo":
            raise ValueError("hacking.enabled watches RL steps' samples; algorithm.name=dpo samples none")
        return self

    @model_validator(mode="after")
    def _lora_needs_torch_backend(self) -> Config:
        if self.model.lora is not None and self.engine.backend != "torch":
            raise ValueError(
                f"model.lora needs engine.backend=torch for now (got {self.engine.backend}): LoRA adapters under"
                " DeepSpeed ZeRO are not supported yet; set engine.backend=torch or remove model.lora"
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
        if self.algorithm.dynamic_sampling and n < 2:
            raise ValueError(
                f"algorithm.dynamic_sampling drops groups whose samples all scored the same: it needs"
                f" rollout.n >= 2 samples per prompt (got {n}); e.g. rollout.n=4"
            )
        if self.algorithm.dynamic_sampling and self.rollout.mode == "server":
            raise ValueError(
                "algorithm.dynamic_sampling with rollout.mode=server is not supported yet (the worker's weight-sync"
                " probe covers one sampling per step); use rollout.mode=colocated or algorithm.dynamic_sampling=false"
            )
        if self.rollout.off_policy_steps and self.rollout.mode != "server":
            raise ValueError(
                f"rollout.off_policy_steps={self.rollout.off_policy_steps} samples ahead of training in a separate"
                " worker: it needs rollout.mode=server (got colocated); set rollout.mode=server or"
                " rollout.off_policy_steps=0"
            )
        budget = self.sampling.max_new_tokens
        if self.reward.overlong_buffer is not None and self.reward.overlong_buffer > budget:
            raise ValueError(
                f"reward.overlong_buffer={self.reward.overlong_buffer} is longer than sampling.max_new_tokens={budget}:"
                f" the penalty ramps over the last overlong_buffer tokens of the budget; set it to at most {budget}"
            )
        if algorithm in ("ppo",) and self.ppo.critic_init == "rm" and not self.reward.learned:
            raise ValueError(
                "ppo.critic_init=rm starts the critic from the round's reward model, but reward.sources has no"
                " model source without a path (so no reward model is trained); set ppo.critic_init=policy or a"
                " critic-free algorithm.name (grpo, rloo, reinforce_pp)"
            )
        if self.reward.uncertainty_penalty > 0 and not (self.rm.ensemble > 1 and self.reward.learned):
            why = (
                f"rm.ensemble={self.rm.ensemble} trains one head; set rm.ensemble=4 (say)"
                if self.reward.learned
                else "no reward source is the round's reward model (a model source without a path)"
            )
            raise ValueError(
                f"reward.uncertainty_penalty={self.reward.uncertainty_penalty} penalises the spread of the round's"
                f" ensemble reward model, but {why}, or set reward.uncertainty_penalty=0"
            )
        world = self.resources.world_size
        # Every rank needs rows in every pass (ZeRO's collectives run in each forward and backward).
        shares = {
            "rl.rollout_batch x rollout.n / rollout.generate_batch chunks": -(
                -self.rl.rollout_batch * n // self.rollout.generate_batch
            ),
            "eval.num_prompts / eval.batch_size chunks": -(-self.eval.num_prompts // self.eval.batch_size),
            "rl.mini_batch": self.rl.mini_batch,
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
        if (moved := moved_key_message(loc, error.get("input"))) is not None:
            return f"{source}: {moved}"
        section = _section_at(loc[:-1])
        # as a config file spells them: rollout.async is the field async_
        valid = ", ".join(sorted(info.alias or name for name, info in section.model_fields.items())) if section else "?"
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
        raise ConfigError(f"override {_shown_override(text)} must look like key.path=value, e.g. rl.steps=20")
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
