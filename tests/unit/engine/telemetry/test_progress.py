"""events.jsonl, callbacks and the console's choice of a bar or lines (engine/telemetry/progress.py)."""

import io
import json
import math

import pytest
from conftest import RecordingSink, sft_inputs, small_config_tree
from helpers.stage_ctx import run

from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.context import StageContext
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.telemetry.metrics import ConsoleSink, FanoutSink
from rlflow.engine.telemetry.progress import (
    QUIET_ENV,
    CallbackSink,
    EventLogSink,
    ProgressSink,
    StepEvent,
    StopRequest,
    StopStage,
    bar_values,
    console_sink,
    events_path,
)


def read_events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_object_per_logged_step_with_mlflow_names(tmp_path):
    path = events_path(str(tmp_path), "r1")
    sink = EventLogSink(path, "r1", 0, "rl")
    sink.log_metrics({"actor/kl": 0.25, "critic/score/mean": float("nan")}, 1)
    sink.log_metrics({"actor/kl": 0.5, "timing_s/step": float("inf")}, 2)
    events = read_events(path)
    assert [(e["round"], e["stage"], e["step"]) for e in events] == [(0, "rl", 1), (0, "rl", 2)]
    assert events[0]["actor/kl"] == 0.25 and events[1]["actor/kl"] == 0.5
    assert events[0]["critic/score/mean"] == "nan" and events[1]["timing_s/step"] == "inf"  # JSON has no NaN
    assert events[0]["time"].endswith("Z") and events[0]["run"] == "r1"


def test_a_resumed_stage_does_not_repeat_steps_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    first = EventLogSink(path, "r", 1, "sft")
    for step in (10, 20, 30):
        first.log_metrics({"sft/loss": step / 10}, step)
    EventLogSink(path, "r", 1, "rm").log_metrics({"rm/loss": 1.0}, 5)  # another stage: its own steps
    with open(path, "a") as f:
        f.write('{"run": "r", "round": 1, "stage": "sft", "st')  # killed mid-write
    resumed = EventLogSink(path, "r", 1, "sft")  # the stage restarts from its step-20 checkpoint
    for step in (21, 30, 31):
        resumed.log_metrics({"sft/loss": -1.0}, step)
    lines = path.read_text().splitlines()
    events = [json.loads(line) for line in lines if not line.endswith('"st')]
    sft = [(e["step"], e["sft/loss"]) for e in events if e["stage"] == "sft"]
    assert sft == [(10, 1.0), (20, 2.0), (30, 3.0), (31, -1.0)]  # 21 and 30 were logged already
    assert len(lines) == len(events) + 1  # the torn line stayed alone on its line


def test_events_of_a_remote_root_stay_local():
    assert str(events_path("s3://bucket/runs", "x")) == "runs/x/events.jsonl"
    assert str(events_path("file:///data/runs", "x")) == "/data/runs/x/events.jsonl"


def test_callbacks_see_every_step_and_add_metrics():
    seen = []

    def reward_per_token(event: StepEvent):
        seen.append((event.stage, event.step, dict(event.metrics)))
        return {"custom/reward_per_token": event.metrics["critic/score/mean"] / event.metrics["response_length/mean"]}

    downstream = RecordingSink()
    callbacks = [("m:f", reward_per_token), ("m:g", lambda e: None)]
    sink = CallbackSink(callbacks, downstream, {"run": "r", "round": 2, "stage": "rl"})
    sink.log_metrics({"critic/score/mean": 3.0, "response_length/mean": 12.0}, 7)
    assert seen == [("rl", 7, {"critic/score/mean": 3.0, "response_length/mean": 12.0})]
    assert downstream.metrics == [
        (7, {"critic/score/mean": 3.0, "response_length/mean": 12.0, "custom/reward_per_token": 0.25})
    ]


def test_returned_metrics_reach_every_sink_once(small_assets, tmp_path, capsys):
    """Through the task's own wiring (tasks/stages.py): console, MLflow stand-in and events.jsonl."""
    from rlflow.tasks.stages import StageSpec, stage_sinks

    tree = small_config_tree(small_assets, tmp_path, run={"name": "cb"})
    tree["callbacks"] = ["helpers.callbacks:reward_per_token"]
    config = build_config(tree, "test")
    spec = StageSpec(stage="rl", round_index=1, identity="i", identity_tree={}, parent_run_id="p")
    mlflow_stand_in = RecordingSink()
    sink = stage_sinks(config, spec, 10, mlflow_stand_in, StopRequest())
    sink.log_metrics({"critic/score/mean": 2.0}, 3)
    sink.close()
    expected = {"critic/score/mean": 2.0, "custom/reward_per_token": 0.5}
    assert mlflow_stand_in.metrics == [(3, expected)]
    events = read_events(events_path(str(tmp_path), "cb"))
    assert [(e["step"], e["custom/reward_per_token"]) for e in events] == [(3, 0.5)]
    assert capsys.readouterr().out.count("[round 1 rl] step 3") == 1


def test_a_callback_cannot_change_the_metrics_or_return_garbage():
    def mutate(event):
        event.metrics["actor/kl"] = 0.0

    sink = CallbackSink([("m:mutate", mutate)], RecordingSink(), {"run": "r", "round": 0, "stage": "rl"})
    with pytest.raises(TypeError):
        sink.log_metrics({"actor/kl": 1.0}, 1)
    bad = CallbackSink([("m:bad", lambda e: {"x": "high"})], RecordingSink(), {"run": "r", "round": 0, "stage": "rl"})
    with pytest.raises(TypeError, match="m:bad must return None or a mapping"):
        bad.log_metrics({"actor/kl": 1.0}, 1)


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal_lines_when_piped_or_quiet(monkeypatch):
    monkeypatch.delenv(QUIET_ENV, raising=False)
    assert isinstance(console_sink("round 0 ppo", 10, (), Tty()), ProgressSink)
    assert isinstance(console_sink("round 0 ppo", 10, (), io.StringIO()), ConsoleSink)  # piped, CI, a log file
    assert isinstance(console_sink("round 0 eval", None, (), Tty()), ConsoleSink)  # no known length
    monkeypatch.setenv(QUIET_ENV, "1")
    assert isinstance(console_sink("round 0 ppo", 10, (), Tty()), ConsoleSink)


def test_the_bar_shows_step_tokens_reward_kl_and_eta():
    stream = Tty()
    sink = ProgressSink("round 1 ppo", 4, stream)
    for step in (1, 2, 3, 4):
        sink.log_metrics({"perf/throughput": 1500.0 + step, "critic/score/mean": 0.5 * step, "actor/kl": 0.01}, step)
    sink.close()
    sink.close()  # twice is harmless (a finally after an early stop)
    out = stream.getvalue()
    assert "round 1 ppo" in out and "4/4" in out and "ETA" in out and "reward=2" in out and "kl=0.01" in out and "tok/s=1504" in out
    assert bar_values({"sft/loss": math.pi}) == "loss=3.142"


def test_a_callback_stops_sft_early_at_a_committed_final_step(small_assets, tmp_path):
    """StopStage from a callback: the step it saw is the stage's last, committed and final."""
    cfg = build_config(small_config_tree(small_assets, tmp_path, sft={"max_steps": 60, "log_every": 5}), "test")

    def stop_on_low_loss(event):
        if event.step >= 15:
            raise StopStage("loss is low enough")

    stop, recorded = StopRequest(), RecordingSink()
    sink = CallbackSink([("hooks:stop_on_low_loss", stop_on_low_loss)], recorded, {"run": "t", "round": 0, "stage": "sft"}, stop)
    store = CheckpointStore(f"{tmp_path}/sft")
    ctx = StageContext(
        store=store, stage="sft", round_index=0, seed=0, identity="i", identity_tree={}, every_steps=100,
        sink=FanoutSink(recorded, sink), stop=stop,
    )
    outcome = run(ctx, sft_inputs(cfg))
    assert outcome.step == 15 and store.final()["step"] == 15 and store.committed_steps() == [15]
    assert outcome.metrics["train/early_stop_step"] == 15.0 and stop.reason == "hooks:stop_on_low_loss: loss is low enough"
    assert max(step for step, _ in recorded.metrics) == 15
    # Without a way to reach the stage (a DeepSpeed job's ranks), the request is an error, not ignored.
    deaf = CallbackSink([("hooks:s", stop_on_low_loss)], RecordingSink(), {"run": "t", "round": 0, "stage": "rl"})
    with pytest.raises(RuntimeError, match="needs engine.backend=torch"):
        deaf.log_metrics({}, 20)
