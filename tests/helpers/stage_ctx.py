"""Stage contexts, calls and inputs for running a stage in a test: round 0, seed 0, an identity, the
stage's checkpoint store under `root` unless one is given, and a RecordingSink unless told. Inputs
come from each stage's own builder (engine/stages/catalog.py), as the flow and the worker make them."""

from conftest import RecordingSink
from rlflow.engine.stages.catalog import run_stage, stage_inputs
from rlflow.engine.stages.context import StageContext
from rlflow.engine.stages.identity import IDENTITY_FORMAT
from rlflow.engine.stages.inputs import ModelInput, RewardModelInput
from rlflow.engine.stages.worker import StageCall
from rlflow.engine.storage.checkpoint import CheckpointStore


def make_ctx(root, stage, identity="id-1", every=10, sink=None, store=None, **fields) -> StageContext:
    """`fields`: any other StageContext field (keep_last, consolidate_every, runtime, limits, stop)."""
    return StageContext(
        store=store or CheckpointStore(f"{root}/{stage}"),
        stage=stage,
        round_index=0,
        seed=0,
        identity=identity,
        identity_tree={"format": IDENTITY_FORMAT, "x": identity},
        every_steps=every,
        sink=sink or RecordingSink(),
        **fields,
    )


def make_call(root, stage, upstream, identity=None, identity_tree=None, **fields) -> StageCall:
    """A round-0 call with its store at root/<stage> and identity "id-<stage>" unless told; `upstream`:
    the stage's upstream record; `fields`: rollout_devices, overrides."""
    return StageCall(
        stage=stage,
        store_url=f"{root}/{stage}",
        round_index=0,
        identity=identity or f"id-{stage}",
        identity_tree={"format": IDENTITY_FORMAT, "stage": stage} if identity_tree is None else identity_tree,
        upstream=upstream.model_dump(mode="json"),
        **fields,
    )


def model(path, identity="test") -> ModelInput:
    """An upstream model at `path` (a folder or a committed step URI)."""
    return ModelInput(uri=str(path), identity=identity)


def reward_model(path, norm=(0.0, 1.0), identity="test") -> RewardModelInput:
    return RewardModelInput(uri=str(path), identity=identity, score_norm=norm)


def inputs(cfg, stage, upstream):
    """`stage`'s inputs record from `cfg` and its upstream record, by the stage's own builder."""
    return stage_inputs(cfg, stage, upstream)


def run(ctx: StageContext, stage_inputs_record):
    """Run the stage as the task and the worker do (engine/stages/catalog.py run_stage)."""
    return run_stage(ctx, stage_inputs_record)


def sft_call(root, init_path, **fields) -> StageCall:
    """A round-0 SFT call from the model at `init_path`."""
    from rlflow.engine.stages.sft import SFTUpstream

    return make_call(root, "sft", SFTUpstream(init=model(init_path)), **fields)


def run_call(config, call: StageCall, ctx: StageContext | None = None, sink=None):
    """Run a call as a task does: its context from the config (unless given), its inputs from the
    stage's own builder."""
    from rlflow.engine.stages.worker import call_inputs, make_context

    return run_stage(ctx or make_context(config, call, sink or RecordingSink()), call_inputs(config, call))


def rl_call(root, policy, reward_model=None, norm=(0.0, 1.0), critic=None, reference=None, sft=None, **fields):
    """A round-0 RL stage call: `policy` as actor, reference and SFT policy unless told, the round's
    reward model at `reward_model` (score statistics `norm`) and the critic's start."""
    from rlflow.engine.stages.rl.inputs import RLUpstream

    upstream = RLUpstream(
        policy=model(policy), reference=model(reference or policy), sft=model(sft or policy),
        reward_model=None if reward_model is None else reward_model_input(reward_model, norm),
        critic=None if critic is None else model(critic),
    )
    return make_call(root, "rl", upstream, **fields)


reward_model_input = reward_model
