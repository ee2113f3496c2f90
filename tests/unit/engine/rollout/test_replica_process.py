"""A replica process as rlflow starts it, with a stand-in server of a few lines (the real ones:
test_hf_replica.py, test_vllm_replica.py): the key reaches it through its environment only, the
trainer's secrets never do, a failed start quotes its log, and close and kill leave nothing behind."""

from __future__ import annotations

import sys

import pytest
import requests

from rlflow.engine.backend.launch import free_port
from rlflow.engine.rollout.replica_auth import REPLICA_KEY_ENV
from rlflow.engine.rollout.replica_process import ReplicaProcess, ReplicaStartError

SERVER = """
import http.server, os, sys
print("env key set:", bool(os.environ.get(sys.argv[2])), "secrets:", os.environ.get("RLFLOW_SECRETS"), flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_started_replica_gets_its_key_from_the_environment_only_and_close_ends_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_SECRETS", "s3-key=hunter2")
    port = free_port()
    command = [sys.executable, "-c", SERVER, str(port), REPLICA_KEY_ENV]
    log = tmp_path / "replica.log"
    replica = ReplicaProcess.launch(command, {}, f"http://127.0.0.1:{port}", what="stand-in", log_path=str(log))
    assert requests.get(replica.url + "/health", timeout=5).status_code == 200
    assert replica.key not in " ".join(replica.proc.args)  # never in argv, which `ps` shows
    assert "env key set: True secrets: None" in log.read_text()
    assert "is running" in replica.failure()
    replica.close()
    assert replica.proc.returncode == -15 and "exited with code -15" in replica.failure()


def test_a_replica_that_dies_or_never_answers_while_starting_is_an_error_quoting_its_log(tmp_path):
    dies = [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)"]
    with pytest.raises(ReplicaStartError, match=r"the stand-in exited with code 3 while starting; .*cannot load"):
        ReplicaProcess.launch(dies, {}, "http://127.0.0.1:9", what="stand-in", log_path=str(tmp_path / "a.log"))
    silent = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    with pytest.raises(ReplicaStartError, match=r"not healthy within 3 s \(rollout.startup_timeout_s\);.*loading"):
        ReplicaProcess.launch(silent, {}, f"http://127.0.0.1:{free_port()}", what="stand-in",
                              log_path=str(tmp_path / "b.log"), startup_timeout_s=3)  # fmt: skip
