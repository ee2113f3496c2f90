"""The flow's side of a breach: the alert webhook, the temporary-server failure with its continue
command, the operator's continue / rollback / stop, and one real pause resumed with new input
through a real Prefect server."""

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from mlflow.tracking import MlflowClient

from conftest import small_config_tree
from helpers.pipeline import cli, finish, prefect_task_runs, resume_paused, wait_paused, write_config
from rlflow.engine.stages.breaker import BREACH_KL, BREACH_REWARD, StageOverrides
from rlflow.engine.stages.context import Breach
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import RunHalted
from rlflow.flows import breach as flow_breach
from rlflow.flows.breach import COMMAND_ENV, BreachDecision, send_alert, settle_breaches, shown_command
from rlflow.tasks.stages import StageResult

SECRETS = ("T0KEN-IN-URL", "B3ARER-SECRET")


class Hook:
    """A webhook receiver on a free local port, recording each POST (headers and JSON body)."""

    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((dict(self.headers), body.decode()))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?token={SECRETS[0]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    server = Hook()
    yield server
    server.close()


def kl_result(step=3, reason=BREACH_KL, uri=""):
    metrics = {"actor/kl": 0.42, "actor/kl_coef": 0.05, "safety/max_kl": 0.1, "safety/kl_patience": 3.0}
    message = f"rollout KL 0.42 stayed above kl.pause_above=0.1; step {step}"
    breach = Breach(reason=reason, step=step, metrics=metrics, message=message)
    return StageResult(
        stage="rl", round_index=0, step=step, checkpoint_uri=uri, manifest_sha256="", metrics={}, breach=breach
    )


def config_with(tmp_path, **sections):
    return build_config(small_config_tree(tmp_path, tmp_path / "runs", **sections), "t")


def test_alert_posts_the_breach_as_json_without_secrets(hook, tmp_path, caplog):
    headers = {"Authorization": f"Bearer {SECRETS[1]}"}
    config = config_with(tmp_path, alerts={"webhook_url": hook.url, "headers": headers, "timeout_s": 5})
    with caplog.at_level(logging.INFO):
        assert send_alert(config, kl_result())
    (received_headers, body), = hook.received
    assert json.loads(body) == {
        "run": "t",
        "round": 0,
        "stage": "rl",
        "step": 3,
        "reason": "kl",
        "metrics": {"actor/kl": 0.42, "actor/kl_coef": 0.05, "safety/max_kl": 0.1, "safety/kl_patience": 3.0},
    }
    assert received_headers["Authorization"] == headers["Authorization"]  # sent, but never shown
    assert not any(secret in body or secret in caplog.text for secret in SECRETS)
    # A webhook that cannot be reached only warns, and its URL stays out of the warning.
    hook.close()
    with caplog.at_level(logging.INFO):
        assert not send_alert(config, kl_result())
    assert "alert webhook (alerts.webhook_url) failed" in caplog.text
    assert not any(secret in caplog.text for secret in SECRETS)


def test_temporary_server_fails_with_the_exact_continue_command(tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert flow_breach.temporary_server()
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert not flow_breach.temporary_server()
    monkeypatch.setattr(flow_breach, "temporary_server", lambda: True)
    monkeypatch.setenv(COMMAND_ENV, shown_command("c.yaml", ["rl.steps=3", "run.storage_options.key=S3CR3T"]))
    never = lambda *args: pytest.fail("nothing may be asked or run again on a temporary server")  # noqa: E731
    with pytest.raises(RunHalted) as raised:
        settle_breaches(config_with(tmp_path), kl_result(), never, never)
    message = str(raised.value)
    assert "\n" not in message and "S3CR3T" not in message
    # A redacted credential is not part of a command that would set it to "***": it is named.
    assert message.endswith(
        "continue with: rlflow run c.yaml rl.steps=3 run.name=t kl.pause_above=0.84"
        " (and your values of run.storage_options.key again)"
    )
    with pytest.raises(RunHalted) as raised:  # a reward failure: the same command, once the source works
        settle_breaches(config_with(tmp_path), kl_result(reason=BREACH_REWARD), never, never)
    assert str(raised.value).endswith("rl.steps=3 run.name=t (and your values of run.storage_options.key again)")


def _committed_store(tmp_path, steps):
    store = CheckpointStore(f"{tmp_path}/runs/t/round_0/rl")
    for step in steps:
        with store.writer(step) as writer:
            writer.write_bytes("x.bin", b"x")
    return store


def test_operator_continues_rolls_back_or_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(flow_breach, "temporary_server", lambda: False)
    store = _committed_store(tmp_path, (2, 4, 6))
    config, calls = config_with(tmp_path), []
    answers = iter([BreachDecision(action="rollback", rollback_step=4, kl_coef=0.1), BreachDecision(max_kl=1.0)])

    def rerun(overrides):  # first continuation breaches again at step 6, the second finishes
        calls.append(overrides)
        return kl_result(step=6) if len(calls) == 1 else kl_result().model_copy(update={"breach": None})

    done = settle_breaches(config, kl_result(step=6), rerun, lambda *_: next(answers))
    assert done.breach is None and store.committed_steps() == [2, 4]  # step 6 went, the chosen one stayed
    assert calls == [StageOverrides(None, 0.1, 4), StageOverrides(1.0, None, 6)]
    with pytest.raises(RunHalted, match="stopped by the operator after: rollout KL 0.42"):
        settle_breaches(config, kl_result(), rerun, lambda *_: BreachDecision(action="stop"))


def test_a_rollback_to_an_uncommitted_step_is_refused_and_asked_again(tmp_path, monkeypatch, caplog):
    _committed_store(tmp_path, (2, 4))
    answers = iter([BreachDecision(action="rollback", rollback_step=3), BreachDecision(action="stop")])
    monkeypatch.setattr(flow_breach, "pause_flow_run", lambda **kwargs: next(answers))
    with caplog.at_level(logging.ERROR):
        decision = flow_breach.ask_operator(config_with(tmp_path), kl_result(step=4))
    assert decision.action == "stop"
    assert "rollback_step=3 is not a committed step (committed: [2, 4]); pausing again" in caplog.text


def test_kl_breach_pauses_the_flow_run_and_resumes_with_new_input(prefect_server, small_assets, tmp_path, hook):
    root, data = tmp_path / "runs", {}
    for name, rows in (("preferences", 64), ("preferences_eval", 32)):  # a 2-step reward model: quality is moot
        lines = (small_assets / "data" / f"{name}.jsonl").read_text().splitlines()[:rows]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        data[name] = str(tmp_path / f"{name}.jsonl")
    tree = small_config_tree(
        small_assets,
        root,
        run={"name": "paused"},
        data=data,
        sft={"rounds": []},  # PPO from the base model: the breach comes quickly
        rl={"steps": 3, "actor_lr": 1e-3},
        kl={"pause_above": 1e-6, "pause_patience": 1},  # step 1 has KL 0 (policy = reference); step 2 trips
        alerts={"webhook_url": hook.url, "headers": {"Authorization": f"Bearer {SECRETS[1]}"}},
    )
    proc = cli(write_config(tmp_path / "c.yaml", tree))
    flow_run = wait_paused(prefect_server, "paused", proc)
    store = CheckpointStore(str(root / "paused" / "round_0" / "rl"))
    assert store.committed_steps() == [2] and store.final() is None
    (_, body), = hook.received  # the alert went out before the pause
    assert json.loads(body)["step"] == 2 and json.loads(body)["reason"] == "kl"
    resume_paused(prefect_server, flow_run.id, {"action": "continue", "max_kl": 100.0, "kl_coef": 0.3}, proc)
    out = finish(proc)
    assert "[round 0 rl] step 3/3" in out and not any(secret in out for secret in SECRETS)
    assert store.final()["step"] == 3

    flow_runs, tasks = prefect_task_runs(prefect_server, "paused")
    assert [fr.state.type.value for fr in flow_runs] == ["COMPLETED"]
    states = [(t.name, t.state.name) for t in tasks[0]]
    # The breached result was not cached: the continuation ran (resuming at step 2), not "Cached".
    assert states == [("round-0-rm", "Completed"), ("round-0-rl", "Completed"), ("round-0-rl", "Completed"),
                      ("round-0-eval", "Completed")], states
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    ppo = [r for r in client.search_runs([client.get_experiment_by_name("rlflow").experiment_id])
           if r.data.tags.get("rlflow.stage") == "rl"][0]
    assert ppo.info.status == "FINISHED" and ppo.data.tags["rlflow.breach"] == "kl at step 2"
    assert ppo.data.tags["rlflow.resumed_from"] == "2"
    coef = {m.step: m.value for m in client.get_metric_history(ppo.info.run_id, "actor/kl_coef")}
    assert coef[3] == pytest.approx(0.3)  # the operator's coefficient from the continued step on
