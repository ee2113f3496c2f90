"""Stage contexts and calls for running a stage in a test: round 0, seed 0, an identity, the stage's
checkpoint store under `root` unless one is given, and a RecordingSink unless told."""

from conftest import RecordingSink
from rlflow.engine.stages.context import StageContext
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
        identity_tree={"x": identity},
        every_steps=every,
        sink=sink or RecordingSink(),
        **fields,
    )


def make_call(root, stage, identity=None, identity_tree=None, **fields) -> StageCall:
    """A round-0 call with its store at root/<stage> and identity "id-<stage>" unless told; `fields`: the
    stage's inputs (init_path, ppo_inputs, ...)."""
    return StageCall(
        stage=stage,
        store_url=f"{root}/{stage}",
        round_index=0,
        identity=identity or f"id-{stage}",
        identity_tree={"stage": stage} if identity_tree is None else identity_tree,
        **fields,
    )
