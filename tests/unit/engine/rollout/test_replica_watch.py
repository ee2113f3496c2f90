"""A replica ends with the trainer that started it, SIGKILLed trainer included, and takes its helper
processes along (a vLLM server's engine processes); a replica nobody names a trainer for is left alone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from rlflow.engine.rollout.replica_watch import TRAINER_PID_ENV, ExitWithTrainer, watch_trainer

REPLICA = """
import subprocess, sys, time
from rlflow.engine.rollout.replica_watch import watch_trainer
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # an engine process
print(watch_trainer(0.05), helper.pid, flush=True)
time.sleep(120)
"""

TRAINER = """
import sys

import subprocess, os
from rlflow.engine.rollout.replica_watch import TRAINER_PID_ENV
env = dict(os.environ, **{TRAINER_PID_ENV: str(os.getpid())})
proc = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True,
                        start_new_session=True)
print(proc.pid, proc.stdout.readline().strip(), flush=True)
import time; time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # exited; its reaper may be slow
    except FileNotFoundError:
        return True


def test_a_replica_and_its_helpers_end_when_the_trainer_is_sigkilled():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, REPLICA], stdout=subprocess.PIPE, text=True)
    try:
        replica_pid, watching, helper_pid = trainer.stdout.readline().split()
        assert watching == "True" and not _gone(int(replica_pid)) and not _gone(int(helper_pid))
    finally:
        trainer.kill()  # SIGKILL: no finalizer, no close()
        trainer.wait()
    deadline = time.monotonic() + 10
    while not (_gone(int(replica_pid)) and _gone(int(helper_pid))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(int(replica_pid)) and _gone(int(helper_pid))


def test_without_a_trainer_named_nothing_is_watched_and_the_middleware_passes_requests_on(monkeypatch):
    monkeypatch.delenv(TRAINER_PID_ENV, raising=False)
    assert watch_trainer() is False
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    asyncio.run(ExitWithTrainer(app)({"type": "http", "path": "/health"}, None, None))
    assert seen == ["/health"]
