"""The tool journal: what a step records it replays when rerun, kept until a checkpoint holds the
step, per rank, and never across identities."""

from rlflow.engine.envs.base import EnvStep
from rlflow.engine.rollout.episodes import RecordedStep
from rlflow.engine.stages.rl.tool_journal import ToolJournal
from rlflow.engine.storage.checkpoint import CheckpointStore

STEPS = {0: [RecordedStep("a1", EnvStep(observation=[{"role": "tool", "content": "42"}], info={"tool_calls": 1.0})),
             RecordedStep("b2", EnvStep(done=True, reward=0.5))], 1: [RecordedStep("c3", EnvStep(done=True))]}
DONE = {0: [RecordedStep("d4", EnvStep(done=True))]}


def commit(store: CheckpointStore, step: int) -> None:
    with store.writer(step) as writer:
        writer.write_json("x.json", {})


def test_a_rerun_step_replays_what_it_recorded_until_a_checkpoint_holds_it(tmp_path):
    store = CheckpointStore(str(tmp_path / "ppo"))
    journal = ToolJournal(store, "id-1", rank=0)
    journal.begin(1)
    assert journal.replay("7") is None
    journal.record("7", STEPS)
    journal.begin(2)
    journal.record("9", DONE)
    rerun = ToolJournal(store, "id-1", rank=0)  # a new process after a kill, no checkpoint yet
    rerun.begin(1)
    assert rerun.replay("7") == STEPS and rerun.replay("8") is None
    commit(store, 1)
    rerun.begin(2)  # step 1 is in a checkpoint now: its record goes, step 2's stays
    assert store.inflight_names() == ["tools_step_000002_rank_0.json"]
    assert rerun.replay("9") == DONE
    rerun.clear()
    assert store.inflight_names() == []


def test_another_identity_or_rank_is_not_replayed_or_removed(tmp_path):
    store = CheckpointStore(str(tmp_path / "ppo"))
    first = ToolJournal(store, "id-1", rank=1)
    first.begin(3)
    first.record("5", STEPS)
    changed = ToolJournal(store, "id-2", rank=1)
    changed.begin(3)
    assert changed.replay("5") is None
    other_rank = ToolJournal(store, "id-1", rank=0)
    other_rank.begin(3)
    other_rank.clear()
    assert other_rank.replay("5") is None and store.inflight_names() == ["tools_step_000003_rank_1.json"]
