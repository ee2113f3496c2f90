"""Every stage through the catalog on the tiny config: its body reads only its inputs record (the
config raises on any access once the stage's builder has returned), a finished stage comes back from
its store without running, and an unknown stage names the valid ones."""

import pytest

from conftest import RecordingSink, small_config_tree
from helpers.stage_ctx import make_ctx, model, reward_model
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.catalog import STAGES, run_stage, stage_inputs, stage_kind
from rlflow.engine.stages.dpo import DPOUpstream
from rlflow.engine.stages.inputs import LabelsInput, located
from rlflow.engine.stages.label import LabelUpstream
from rlflow.engine.stages.reward_model import RewardModelUpstream
from rlflow.engine.stages.rl.inputs import RLUpstream
from rlflow.engine.stages.round_eval import EvalUpstream
from rlflow.engine.stages.sft import SFTUpstream


class LockedConfig:
    """A Config that raises on any attribute read once locked: what a stage's body may not touch."""

    def __init__(self, config):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_locked", False)

    def lock(self):
        object.__setattr__(self, "_locked", True)

    def __getattr__(self, name):
        if self._locked:
            raise AssertionError(f"config.{name} was read after the stage's inputs were built")
        return getattr(self._config, name)


def upstreams(small_assets, trained, labels_file):
    sft_dir, rm_dir, norm = trained
    tiny, sft, rm = model(small_assets / "tiny-model"), model(sft_dir), reward_model(rm_dir, norm)
    return {
        "sft": SFTUpstream(init=tiny),
        "label": LabelUpstream(policy=sft),
        "rm": RewardModelUpstream(init=sft, labels=(LabelsInput(identity="l", train=labels_file),)),
        "rl": RLUpstream(policy=sft, reference=sft, sft=sft, reward_model=rm, critic=model(rm_dir)),
        "dpo": DPOUpstream(init=sft, reference=sft, labels=LabelsInput(identity="l", train=labels_file)),
        "eval": EvalUpstream(start=sft, final=sft, reference=sft, sft=sft, reward_model=rm),
    }


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_stage_body_reads_only_its_inputs(small_assets, trained, tmp_path, stage):
    tree = small_config_tree(
        small_assets, tmp_path, sft={"max_steps": 4, "eval_every": 2}, rm={"epochs": 1}, rl={"steps": 2},
        dpo={"epochs": 1, "batch_size": 16}, label={"prompts_per_round": 8}, eval={"num_prompts": 8},
    )
    config = LockedConfig(build_config(tree, "t"))
    labels_file = str(small_assets / "data" / "preferences.jsonl")
    kind = stage_kind(stage)
    inputs = kind.inputs_from(config, upstreams(small_assets, trained, labels_file)[stage])
    config.lock()
    ctx = make_ctx(tmp_path, stage, sink=RecordingSink(), every=2)
    outcome = run_stage(ctx, located(inputs, {}))
    assert outcome.stage == stage and outcome.manifest_sha256 and ctx.store.final() is not None
    with pytest.raises(AssertionError, match="was read after"):
        config.run  # noqa: B018  # the lock holds: the body above could not have read it either
    again = run_stage(make_ctx(tmp_path, stage), inputs)  # finished: its recorded outcome, nothing run
    assert again.skipped and again.manifest_sha256 == outcome.manifest_sha256


def test_every_stage_is_declared_once_with_its_upstream_builder_and_body(small_assets, tmp_path):
    config = build_config(small_config_tree(small_assets, tmp_path), "t")
    assert list(STAGES) == ["sft", "label", "rm", "rl", "dpo", "eval"]
    assert {name for name, kind in STAGES.items() if kind.trains} == {"sft", "rm", "rl", "dpo"}
    tiny = model(small_assets / "tiny-model")
    inputs = stage_inputs(config, "sft", {"init": tiny.model_dump()})  # the upstream as JSON, as a worker has it
    assert inputs.upstream.init == tiny and inputs.sft == config.sft
    with pytest.raises(ValueError, match="unknown stage 'ppo'; valid: sft, label, rm, rl, dpo, eval"):
        stage_kind("ppo")
