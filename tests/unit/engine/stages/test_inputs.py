"""A stage's inputs: the model-loading part of model.* with the stage's own adapters, upstream models
located on this machine (a committed step fetched to the cache, a folder as it is) with their
identities untouched, and records that survive JSON."""

from rlflow.engine.config.model import LoraConfig, ModelConfig
from rlflow.engine.config.schema import Config
from rlflow.engine.stages.inputs import LabelsInput, ModelInput, ModelLoading, RewardModelInput, StageLora, located
from rlflow.engine.stages.rl.inputs import RLUpstream, inputs_from
from rlflow.engine.stages.sft import SFTInputs, SFTUpstream
from rlflow.engine.storage.checkpoint import CheckpointStore


def test_a_stage_loads_models_as_configured_with_its_own_adapters_or_none():
    model = ModelConfig(path="somewhere", dtype="bfloat16", lora=LoraConfig(r=4, stages=["rm", "rl"]))
    rl, sft = ModelLoading.for_stage(model, "rl"), ModelLoading.for_stage(model, "sft")
    assert (rl.dtype, rl.trust_remote_code, rl.attn_implementation) == ("bfloat16", False, "sdpa")
    assert sft.lora is None  # model.lora.stages names rl, not sft
    assert rl.lora == StageLora(r=4, alpha=model.lora.alpha, dropout=model.lora.dropout,
                                target_modules=model.lora.target_modules, modules_to_save=[])
    assert "stages" not in StageLora.model_fields  # which stages train adapters is not what rl computes with
    assert "path" not in ModelLoading.model_fields  # the initial policy is an upstream input


def test_upstream_models_are_located_on_this_machine_and_keep_their_identities(tmp_path):
    store = CheckpointStore(str(tmp_path / "rl"))
    with store.writer(3) as writer:
        writer.write_bytes("model/config.json", b"{}")
    step = ModelInput(uri=store.step_url(3), identity="manifest-3")
    folder = ModelInput(uri=str(tmp_path / "plain-folder"), identity="sha256:abc")
    upstream = RLUpstream(policy=step, reference=folder, sft=folder,
                          reward_model=RewardModelInput(uri=store.step_url(3), identity="rm", score_norm=(0.0, 1.0)))
    there = located(inputs_from(Config(), upstream), {}).upstream
    assert there.policy.uri == f"{store.local_dir(3)}/model" and there.policy.identity == "manifest-3"
    assert there.reference == folder  # a folder is used where it is
    assert there.reward_model.uri == f"{store.local_dir(3)}/model" and there.reward_model.score_norm == (0.0, 1.0)
    assert there.critic is None


def test_inputs_records_survive_json_with_their_types():
    inputs = SFTInputs.model_validate_json(_sft_inputs().model_dump_json())
    assert inputs == _sft_inputs() and isinstance(inputs.upstream.init, ModelInput)
    labels = LabelsInput(identity="l", train="pairs.jsonl")
    assert LabelsInput.model_validate_json(labels.model_dump_json()).held_out is None


def _sft_inputs():
    from rlflow.engine.stages.sft import inputs_from as sft_inputs_from

    return sft_inputs_from(Config(), SFTUpstream(init=ModelInput(uri="m", identity="i")))
