"""A rollout replica process rlflow starts: its command, its log, a bounded start, a sure end.

    replica = ReplicaProcess.launch(command, env, url, log_path, startup_timeout_s=300, what="vLLM replica")
    client = ReplicaClient(replica.url, replica.key, tokenizer, on_failure=replica.failure)
    ...
    replica.close()

The server gets its API key through its environment only (never argv, which `ps` shows), runs in a
session of its own (its helper processes go with it), is killed by a finalizer if nobody closes it,
and kills itself when this process is gone, SIGKILLed included (replica_watch.py).
Which server: engine/rollout/vllm_replica.py (vLLM's) or hf_replica.py (rlflow's, transformers).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import time
import weakref

import requests

from rlflow.engine.errors import RlflowError
from rlflow.engine.rollout.replica_auth import REPLICA_KEY_ENV
from rlflow.engine.rollout.replica_watch import TRAINER_PID_ENV

POLL_S = 0.5
LOG_TAIL_LINES = 8
EXIT_GRACE_S = 1.0  # a connection broken by a dying replica may come before its exit code
SCRUBBED_ENV = ("RLFLOW_SECRETS", "VLLM_API_KEY")  # nothing a replica needs, and secrets of the trainer's


class ReplicaStartError(RlflowError):
    """The replica process failed to start or to become healthy in time (the message quotes its log)."""


def _kill(proc: subprocess.Popen) -> None:
    """Finalizer: no orphan server (nor its helper processes) even if close() is never called."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def new_log(prefix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return path


class ReplicaProcess:
    def __init__(self, proc: subprocess.Popen, url: str, key: str, log_path: str, what: str):
        self.proc, self.url, self.key, self.log_path, self.what = proc, url, key, log_path, what
        self._finalizer = weakref.finalize(self, _kill, proc)

    @classmethod
    def launch(
        cls,
        command: list[str],
        env: dict[str, str],
        url: str,
        *,
        what: str,
        key: str | None = None,
        log_path: str | None = None,
        startup_timeout_s: float = 300.0,
    ) -> ReplicaProcess:
        """Start `command` with os.environ (less SCRUBBED_ENV) updated by `env` and the key; wait until
        GET url/health answers 200 (at most startup_timeout_s)."""
        key = key or secrets.token_urlsafe(32)
        log_path = log_path or new_log("rlflow-replica-")
        full_env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        full_env |= env | {REPLICA_KEY_ENV: key, TRAINER_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,  # its helper processes go with it in close()
            )
        replica = cls(proc, url, key, log_path, what)
        try:
            replica.wait_healthy(startup_timeout_s)
        except BaseException:
            replica.close()
            raise
        return replica

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ReplicaStartError(
                    f"the {self.what} exited with code {self.proc.returncode} while starting; {self.failure()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=POLL_S * 4).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ReplicaStartError(
                    f"the {self.what} was not healthy within {timeout_s:g} s (rollout.startup_timeout_s);"
                    f" {self.failure()}"
                )
            time.sleep(POLL_S)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        try:
            with open(self.log_path, errors="replace") as f:
                return [line.rstrip() for line in f.readlines()[-lines:]]
        except OSError:
            return []

    def failure(self) -> str:
        """What a failed request adds: whether the process is alive, and the end of its log. A process
        that is dying is given a moment to exit, so that its exit code is what gets reported."""
        try:
            self.proc.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        state = "running" if self.proc.poll() is None else f"exited with code {self.proc.returncode}"
        return f"the replica process {self.proc.pid} is {state}; its log {self.log_path} ends: " + " | ".join(
            self.log_tail(3)
        )

    def kill(self) -> None:
        """SIGKILL the server and its helper processes, as a machine's death would (fault tests)."""
        _kill(self.proc)

    def close(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after timeout_s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout_s)
            except ProcessLookupError:
                pass
        self._finalizer.detach()
