"""The shared step loop with a small stage of its own (a StageSteps implementation that counts):
the steps it runs from a fresh start and a resume, the checkpoint cadence (scheduled, whole every
consolidate_every-th, the last step, a step the stage keeps), what it logs, a stop request ending
the stage with a commit, and too many skipped updates in a row."""

import dataclasses

import pytest

from conftest import RecordingSink
from helpers.stage_ctx import make_ctx
from rlflow.engine.errors import NonFiniteUpdates
from rlflow.engine.stages.guard import StageGuard
from rlflow.engine.stages.loop import LoopEnd, StepReport, run_stage_loop
from rlflow.engine.telemetry.progress import StopRequest


class Engine:
    poison_loss = None  # set by the loop before each update


@dataclasses.dataclass
class CountingStage:
    """Runs `total` steps; logs every `log_every`-th; keeps the steps in `keep`; skips the updates
    in `skipped`; commits by recording (step, whole, last)."""

    total: int
    log_every: int = 2
    keep: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    stop: StopRequest | None = None
    stop_at: int | None = None

    def __post_init__(self):
        self.engines = (Engine(),)
        self.updates, self.commits, self.stopping = [], [], []

    def more(self, step):
        return step < self.total

    def update(self, step):
        self.updates.append(step)
        return {"loss": float(step), "skipped": float(step in self.skipped)}

    def report(self, step, metrics, stopping):
        self.stopping.append(stopping)
        if step == self.stop_at:  # as a callback's StopStage would, while the step is logged
            self.stop.reason, self.stop.step = "enough", step
        return StepReport(metrics, last=step == self.total, log=step % self.log_every == 0, keep=step in self.keep)

    def commit(self, step, whole, last):
        self.commits.append((step, whole, last))
        return f"mem://ckpt/{step}"

    def pause(self, breach):
        raise AssertionError("this stage never breaches")


def run(ctx, stage, resumed_from=None):
    return run_stage_loop(ctx, StageGuard(ctx, resumed_from), stage, resumed_from or 0)


def test_a_fresh_stage_runs_every_step_and_commits_on_the_cadence_and_at_its_end(tmp_path):
    ctx = dataclasses.replace(make_ctx(tmp_path, "sft", every=3), consolidate_every=2)
    stage = CountingStage(total=7)
    assert run(ctx, stage) == LoopEnd(7, None)
    assert stage.updates == [1, 2, 3, 4, 5, 6, 7]
    # step 3 is the 1st scheduled checkpoint (not whole), step 6 the 2nd (whole), step 7 the last (whole)
    assert stage.commits == [(3, False, False), (6, True, False), (7, True, True)]
    assert stage.engines[0].poison_loss is False


def test_logged_steps_carry_the_stages_metrics_the_skip_count_and_the_elapsed_time(tmp_path):
    sink = RecordingSink()
    stage = CountingStage(total=5, log_every=2)
    run(make_ctx(tmp_path, "sft", every=10, sink=sink), stage)
    assert [step for step, _ in sink.metrics] == [2, 4]
    step, metrics = sink.metrics[1]
    assert metrics["loss"] == 4.0 and metrics["train/nonfinite_skips"] == 0.0 and metrics["timing_s/elapsed"] >= 0
    assert "skipped" not in metrics  # the loop takes it out: it is counted, not logged


def test_a_resumed_stage_continues_after_its_step_and_logs_the_resume_time(tmp_path):
    sink = RecordingSink()
    stage = CountingStage(total=6, log_every=100)
    assert run(make_ctx(tmp_path, "sft", every=2, sink=sink), stage, resumed_from=4) == LoopEnd(6, None)
    assert stage.updates == [5, 6]
    assert stage.commits == [(6, True, True)]
    assert [(step, list(m)) for step, m in sink.metrics] == [(5, ["checkpoint/resume_s"])]


def test_a_finished_stage_runs_no_step(tmp_path):
    stage = CountingStage(total=3)
    assert run(make_ctx(tmp_path, "sft"), stage, resumed_from=3) == LoopEnd(3, None)
    assert stage.updates == [] and stage.commits == []


def test_a_step_the_stage_keeps_is_committed_whole_off_the_cadence(tmp_path):
    ctx = dataclasses.replace(make_ctx(tmp_path, "ppo", every=4), consolidate_every=100)
    stage = CountingStage(total=6, keep=(3,))
    run(ctx, stage)
    assert stage.commits == [(3, True, False), (4, False, False), (6, True, True)]


def test_a_stop_request_makes_that_step_the_last_and_commits_it(tmp_path):
    stop = StopRequest()
    ctx = dataclasses.replace(make_ctx(tmp_path, "sft", every=100), stop=stop)
    stage = CountingStage(total=10, stop=stop, stop_at=3)
    assert run(ctx, stage) == LoopEnd(3, None)
    assert stage.updates == [1, 2, 3] and stage.commits == [(3, True, True)]
    assert stage.stopping == [False, False, False]  # it was asked during step 3's report


def test_skipped_updates_are_counted_and_too_many_in_a_row_stop_the_stage(tmp_path):
    sink = RecordingSink()
    stage = CountingStage(total=8, log_every=1, skipped=(2, 4, 5, 6))
    run(make_ctx(tmp_path, "sft", every=100, sink=sink), stage)  # at most 3 in a row: it goes on
    assert [m["train/nonfinite_skips"] for _, m in sink.metrics] == [0.0, 1.0, 1.0, 2.0, 3.0, 4.0, 4.0, 4.0]
    stage = CountingStage(total=8, skipped=(3, 4, 5, 6))
    with pytest.raises(NonFiniteUpdates, match=r"4 updates in a row .*max_nonfinite_skips=3. at step 6"):
        run(make_ctx(tmp_path / "again", "sft", every=2), stage)
    assert stage.commits == [(2, True, False), (4, True, False)]  # nothing after the failure is committed
