"""How stages report numbers (rlflow.engine.telemetry.metrics): the console line, fan-out to several
sinks, and a rank's event lines replayed into the real sinks unchanged."""

import io
import json
import math

from conftest import RecordingSink
from rlflow.engine.telemetry.metrics import (
    EVENT_PREFIX,
    ConsoleSink,
    EventSink,
    FanoutSink,
    replay_event,
)


def test_the_console_line_shows_the_chosen_keys_short_and_the_step_of_the_total():
    stream = io.StringIO()
    sink = ConsoleSink("round 0 ppo", 40, keys=("kl", "reward", "absent"), stream=stream)
    sink.log_metrics({"reward": 0.123456, "kl": 1e-5, "other": 3.0, "steps": 12}, 12)
    line = stream.getvalue()
    assert line.startswith("[round 0 ppo] step 12/40 (") and line.endswith(" s) kl=1e-05 reward=0.1235\n")
    # no keys chosen: the first six names in order; no known length: no total; nan as it is
    stream = io.StringIO()
    ConsoleSink("eval", None, stream=stream).log_metrics({f"k{i}": float(i) for i in range(8)} | {"a": math.nan}, 3)
    assert stream.getvalue().split(") ", 1)[1] == "a=nan k0=0 k1=1 k2=2 k3=3 k4=4\n"
    assert stream.getvalue().startswith("[eval] step 3 (")


def test_fanout_gives_every_sink_every_call_and_closes_those_that_can_close():
    class Closing(RecordingSink):
        closed = 0

        def close(self):
            self.closed += 1

    first, second = Closing(), RecordingSink()  # the second has no close(): it is left out
    sink = FanoutSink(first, second)
    sink.log_metrics({"loss": 2.0}, 1)
    sink.log_table("samples", [{"prompt": "p", "answer": "a"}])
    sink.log_text("checkpoint.txt", "file:///ckpt/step_1")
    sink.close()
    for recorded in (first, second):
        assert recorded.metrics == [(1, {"loss": 2.0})]
        assert recorded.tables == {"samples": [{"prompt": "p", "answer": "a"}]}
        assert recorded.texts == {"checkpoint.txt": "file:///ckpt/step_1"}
    assert first.closed == 1


def test_event_lines_replay_every_call_into_another_sink_including_nonfinite_values():
    stream = io.StringIO()
    events = EventSink(stream)
    events.log_metrics({"loss": 0.5, "kl": math.inf, "steps": 3}, 7)
    events.log_table("samples", [{"answer": "ü"}])
    events.log_text("uri.txt", "s3://b/x")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith(EVENT_PREFIX) for line in lines)
    assert json.loads(lines[2][len(EVENT_PREFIX) :]) == {"kind": "text", "name": "uri.txt", "text": "s3://b/x"}
    replayed = RecordingSink()
    assert all(replay_event(line, replayed) for line in lines)
    assert replayed.metrics == [(7, {"loss": 0.5, "kl": math.inf, "steps": 3.0})]  # every value a float
    assert replayed.tables == {"samples": [{"answer": "ü"}]} and replayed.texts == {"uri.txt": "s3://b/x"}
    assert not replay_event("hello from rank 0", replayed) and len(replayed.metrics) == 1

