"""The identity property, for every stage and every leaf key of Config: changed to another valid
value, a key changes the stage's identity exactly when the stage's inputs builder reads it (the
inputs record it makes changes) and the key is not marked (neutral or wiring on its field, or a
secret). Three base configs between them set every section: a learned-reward PPO round with online
labels, LoRA, an ensemble, a judge, the hacking detector and a regression set; a DPO round on the
DeepSpeed backend; a GRPO round of multi-turn episodes. Keys no base can change are listed in
UNCHANGEABLE with the reason, and the list is checked to be exact."""

import fnmatch
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from conftest import small_config_tree
from rlflow.engine.config.base import identity_mark
from rlflow.engine.config.schema import Config, build_config
from rlflow.engine.config.secrets import SECRET_KEY_PATTERN
from rlflow.engine.errors import ConfigError
from rlflow.engine.stages.catalog import STAGES, stage_inputs
from rlflow.engine.stages.dpo import DPOUpstream
from rlflow.engine.stages.identity import ContentHasher, identity_of, identity_tree
from rlflow.engine.stages.inputs import LabelsInput, ModelInput, RewardModelInput
from rlflow.engine.stages.label import LabelUpstream
from rlflow.engine.stages.reward_model import RewardModelUpstream
from rlflow.engine.stages.rl.inputs import RLUpstream
from rlflow.engine.stages.round_eval import EvalUpstream
from rlflow.engine.stages.sft import SFTUpstream

M = ModelInput(uri="/m", identity="model")
RM = RewardModelInput(uri="/rm", identity="rm", score_norm=(0.0, 1.0))
LABELS = LabelsInput(identity="labels", train="/labels/pairs.jsonl")
UPSTREAM = {
    "sft": SFTUpstream(init=M),
    "label": LabelUpstream(policy=M),
    "rm": RewardModelUpstream(init=M, labels=(LABELS,)),
    "rl": RLUpstream(policy=M, reference=M, sft=M, reward_model=RM, critic=M),
    "dpo": DPOUpstream(init=M, reference=M, labels=LABELS),
    "eval": EvalUpstream(start=M, final=M, reference=M, sft=M, reward_model=RM),
}

# Keys no base config can set to another valid value on their own, and why (checked to be exact).
UNCHANGEABLE = {
    "reward.sources.*.type": "a source's type goes with its other fields (fn only for function, path only for"
    " model): another type alone is refused",
    "reward.sources.*.name": "reward.valid or reward.judge names the source (its rename alone is refused), or"
    " the rename of the round's reward model source is checked in the first base",
    "reward.sources.*.fn": "None on every source but a function, where fn is required: set only with its type",
    "reward.sources.*.path": "None on every source but a model with a path: a path on the round's own model"
    " source makes the round train no reward model, which ppo.critic_init=rm refuses",
    "reward.sources.2.weight": "the judge's weight must be 0 (reward.judge names it)",
    "env": "the bases without an env refuse one (online labels of a learned reward; DPO): its keys are checked"
    " in the env base",
    "rollout.partial_rollouts": "only with rollout.async, which the first base leaves off",
    "rollout.replicas": "only with rollout.mode=server and server_backend=vllm, which no base sets",
    "rollout.endpoints": "only with rollout.mode=server and server_backend=vllm, which no base sets",
}


def _model_dir(root: Path, name: str, content: str) -> str:
    folder = root / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(content)
    return str(folder)


@pytest.fixture(scope="module")
def files(small_assets, tmp_path_factory):
    """Files the base configs name, and copies with other content each key can be changed to."""
    root = tmp_path_factory.mktemp("identity-property")
    weights = root / "judge.json"
    weights.write_text('{"w": 1}')
    regression = root / "regression.jsonl"
    regression.write_text('{"prompt": "p", "response": "r"}\n')
    return {
        "root": root,
        "weights": str(weights),
        "regression": str(regression),
        "judge_model": _model_dir(root, "judge-model", '{"a": 1}'),
    }


def _ppo_tree(small_assets, files) -> dict:
    valid = {"name": "valid", "type": "function", "fn": "rlflow.engine.tasksets.demo:in_vocabulary", "weight": 1}
    judge = {"name": "judge", "type": "function", "fn": "rlflow.engine.tasksets.demo_judge:second_rater",
             "weight": 0, "kwargs": {"weights": files["weights"]}}
    second = {"name": "rm2", "type": "model", "weight": 0, "path": files["judge_model"]}
    return small_config_tree(
        small_assets, files["root"] / "runs",
        data={"regression": files["regression"]},
        model={"lora": {"r": 4, "stages": ["sft", "rm", "rl"]}},
        rm={"ensemble": 2},
        reward={"sources": [{"name": "rm", "type": "model"}, valid, judge, second], "valid": "valid",
                "judge": "judge", "uncertainty_penalty": 1.0, "on_failure": "fallback_rule",
                "fallback_rule": {"fn": "helpers.reward_fns:constant_rule"}},
        hacking={"enabled": True},
        label={"online_from_round": 0, "eval_fraction": 0.25, "human_inbox": str(files["root"] / "inbox")},
        checkpoint={"keep_best": "eval/kl", "keep_best_mode": "min", "mirror": str(files["root"] / "mirror")},
        rollout={"mode": "server"},
        kl={"pause_above": 1.0, "estimator": "k3", "in_loss": False},
        eval={"curve_prompts": 8},
        rl={"clip_ratio_low": 0.1, "clip_ratio_high": 0.3},
        sft={"rounds": [0, 2]},
    )


def _dpo_tree(small_assets, files) -> dict:
    return small_config_tree(
        small_assets, files["root"] / "runs-dpo",
        algorithm={"name": "dpo"},
        engine={"backend": "deepspeed", "zero_stage": 3, "micro_batch_size": 4},
        rollout={"generate_batch": 8}, eval={"batch_size": 16},  # every one of 2 ranks would get chunks
        label={"online_from_round": 1},
        dpo={"reference": "sft"},
    )


def _env_tree(small_assets, files) -> dict:
    return small_config_tree(
        small_assets, files["root"] / "runs-env",
        algorithm={"name": "grpo", "dynamic_sampling": True},
        rollout={"n": 2},
        data={"chat_template": "auto"},
        reward={"sources": [{"name": "length", "type": "length", "kwargs": {"target": 5}}]},
        env={"fn": "helpers.envs:ScriptedEnv", "kwargs": {"turns": 2}, "max_turns": 3},
        label={"online_from_round": None},
    )


BASES = {
    "ppo": (_ppo_tree, ("sft", "label", "rm", "rl", "eval")),
    "dpo": (_dpo_tree, ("sft", "label", "dpo", "eval")),
    "env": (_env_tree, ("sft", "rl", "eval")),
}


def leaves(model: BaseModel, prefix: str = ""):
    """(dotted key, field, value) of every leaf of a config: a section's fields, items of a list of
    sections by index; an unset optional section is one leaf."""
    for name, field in type(model).model_fields.items():
        key, value = prefix + (field.alias or name), getattr(model, name)
        if isinstance(value, BaseModel):
            yield from leaves(value, key + ".")
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            for i, item in enumerate(value):
                yield from leaves(item, f"{key}.{i}.")
        else:
            yield key, field, value


def marked(key: str) -> bool:
    """Whether the key (or a section above it) is marked neutral or wiring, or is a secret."""
    section: typing.Any = Config
    for part in key.split("."):
        if part.isdigit():
            continue
        if SECRET_KEY_PATTERN.match(part):
            return True
        field = next(f for n, f in section.model_fields.items() if (f.alias or n) == part)
        mark = identity_mark(field)
        if mark is not None and mark.excluded:
            return True
        inner = [a for a in typing.get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            inner = [field.annotation]
        if typing.get_origin(field.annotation) is list:
            inner = [a for a in typing.get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        section = inner[0] if inner else None
    return False


# Candidates for keys whose type alone does not give a valid other value (None, names, lists, refs).
SPECIFIC = {
    "model.gguf_file": ["m.gguf"],
    "model.lora": [{"r": 4}],
    "model.lora.target_modules": [["q_proj"]],
    "model.lora.modules_to_save": [["embed_tokens"]],
    "model.lora.stages": [["sft", "rm"], ["rm", "rl", "dpo"]],
    "sft.rounds": [[0], [0, 1]],
    "eval.curve_prompts": [8, 4],
    "label.online_from_round": [0, 1, None],
    "label.human_inbox": ["inbox-elsewhere", None],
    "kl.estimator": ["k2", None],
    "rollout.max_logprob_diff": [0.01],
    "rollout.weights_url": ["file:///shared/weights"],
    "kl.in_loss": [True, None],
    "kl.pause_above": [0.5, None],
    "kl.stop_above": [0.5, None],
    "rl.clip_ratio_low": [0.15, None],
    "rl.clip_ratio_high": [0.35, None],
    "rm.init": ["models/elsewhere"],
    "reward.valid": ["judge", None],
    "reward.judge": ["rm2", None],
    "reward.fallback_rule": [{"fn": "helpers.reward_fns:zero"}, None],
    "reward.overlong_buffer": [4],
    "checkpoint.mirror": ["mirror-elsewhere", None],
    "checkpoint.keep_best": ["eval/gold_score", None],
    "checkpoint.mirror_storage_options": [{"key": "k"}],
    "tracking.uri": ["sqlite:///elsewhere.db"],
    "engine.micro_batch_size": [4, None],
    "engine.max_tokens_per_microbatch": [64],
    "engine.backend": ["deepspeed", "torch"],
    "engine.zero_stage": [1, 2, 3],
    "resources.hostfile": ["hosts"],
    "resources.master_port": [29511],
    "resources.gpu_type": ["a100-80g"],
    "placement.train": [[0]],
    "placement.rollout": [[0]],
    "rollout.threads": [1],
    "hacking.max_spread_ratio": [1.5, None],
    "resources.nproc_per_node": [2],
    "resources.nnodes": [2],
    "stage.*.retries": [2],
    "stage.*.retry_delay_s": [3.0],
    "stage.*.hang_timeout_s": [30.0],
    "stage.hang_timeout_s": [30.0, None],
    "alerts.webhook_url": ["http://127.0.0.1:9/hook"],
    "alerts.headers": [{"Authorization": "Bearer x"}],
    "env": [{"fn": "helpers.envs:ScriptedEnv"}],
    "env.fn": ["helpers.envs:LongerScriptedEnv"],
    "env.kwargs": [{"turns": 3}],
    "callbacks": [["helpers.callbacks:reward_per_token"]],
    "algorithm.name": ["ppo", "grpo", "rloo", "reinforce_pp", "dpo"],
    "algorithm.policy_loss": ["gspo", "cispo"],
    "algorithm.rollout_correction": ["tis", "mis"],
    "promotion.gates.*.metric": ["gold_gain", "kl", "length_ratio"],
    "promotion.gates.*.min": [0.1, None],
    "promotion.gates.*.max": [3.0, None],
    "gold.fn": ["helpers.reward_fns:zero"],
    "label.labeller.fn": ["helpers.reward_fns:prefer_longer"],
    "reward.sources.*.kwargs": [{"weights": "CHANGED_FILE"}, {"keywords": ["x"]}, {"target": 7}, {}],
    "reward.sources.*.on_error": ["skip", "fail", None],
    "run.name": ["other-name", None],
}


def candidates(key: str, field, value, files: dict) -> list:
    for pattern, options in SPECIFIC.items():
        if fnmatch.fnmatchcase(key, pattern):
            return options
    mark = identity_mark(field)
    if mark is not None and mark.kind == "file":
        changed = Path(files["root"]) / f"{key}.jsonl"  # another file: other content, another name
        changed.write_text((Path(value).read_text() if value else "") + '{"prompt": "one more"}\n')
        return [str(changed)]
    if mark is not None and mark.kind == "model":
        return [_model_dir(Path(files["root"]), key, '{"other": 1}')]
    if isinstance(value, bool):
        return [not value]
    options = [a for t in (field.annotation, *typing.get_args(field.annotation)) for a in typing.get_args(t)
               if typing.get_origin(t) is typing.Literal]
    if options:
        return [o for o in options if o != value]
    if isinstance(value, int):
        return [value + 1, value - 1, value * 2]
    if isinstance(value, float):
        return [value * 1.5, value / 2, value + 0.1]
    if isinstance(value, str):
        return [value + "x"]
    if isinstance(value, dict):
        return [value | {"extra_key": 1}]
    return []


def _set(tree: dict, key: str, value) -> dict:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    last = parts[-1]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return tree


def changed_config(base: Config, key: str, value) -> Config | None:
    tree = _set(base.model_dump(mode="json", by_alias=True), key, value)
    try:
        return build_config(tree, "property")
    except ConfigError:
        return None


def identities(config: Config, stage: str, content: ContentHasher) -> tuple[dict, str]:
    inputs = stage_inputs(config, stage, UPSTREAM[stage])
    return inputs.model_dump(mode="json"), identity_of(identity_tree(stage, inputs, content))


def test_every_stage_identity_changes_exactly_when_its_inputs_read_an_unmarked_key(small_assets, files):
    checked, violations, changeable = {}, [], set()
    all_keys = set()
    for base_name, (make_tree, stages) in BASES.items():
        base = build_config(make_tree(small_assets, files), base_name)
        content = ContentHasher()
        reference = {stage: identities(base, stage, content) for stage in stages}
        for key, field, value in leaves(base):
            all_keys.add(key)
            options = candidates(key, field, value, files)
            if key.endswith(".kwargs") and {"weights": "CHANGED_FILE"} in options:
                other = Path(files["root"]) / "judge-other.json"
                other.write_text('{"w": 2}')
                options = [{"weights": str(other)} if o == {"weights": "CHANGED_FILE"} else o for o in options]
            config = next((c for o in options if o != value and (c := changed_config(base, key, o)) is not None), None)
            if config is None:
                continue
            changeable.add(key)
            for stage in stages:
                record, identity = identities(config, stage, content)
                read = record != reference[stage][0]
                expected = read and not marked(key)
                checked[(stage, key)] = checked.get((stage, key), 0) + 1
                if (identity != reference[stage][1]) != expected:
                    violations.append(f"{base_name}/{stage}: {key} (read={read}, marked={marked(key)})")
    assert violations == []
    never = sorted(k for k in all_keys - changeable)
    listed = lambda k: any(fnmatch.fnmatchcase(k, p) for p in UNCHANGEABLE)  # noqa: E731
    assert [k for k in never if not listed(k)] == [], f"keys no base could change (list them with the reason): {never}"
    assert all(any(fnmatch.fnmatchcase(k, p) for k in never) for p in UNCHANGEABLE), "a listed key can change"
    stages = {stage for stage, _ in checked}
    keys = {key for _, key in checked}
    print(f"\nidentity property: {len(checked)} (stage, key) pairs checked, {len(stages)} stages x {len(keys)} keys;"
          f" {len(never)} keys unchangeable: {never}")
    assert stages == set(STAGES) and len(keys) > 150  # a stage added to the catalog is covered, or this fails


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_chat_template_is_in_every_stage_identity(small_assets, files, stage):
    base = build_config(_dpo_tree(small_assets, files) if stage == "dpo" else _ppo_tree(small_assets, files), "t")
    chat = changed_config(base, "data.chat_template", "auto")
    assert identities(chat, stage, ContentHasher())[1] != identities(base, stage, ContentHasher())[1]
