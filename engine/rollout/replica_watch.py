"""A replica rlflow starts ends with the process that started it, even when that one is SIGKILLed.

`ReplicaProcess.launch` starts every replica as the leader of a session of its own and names the
trainer in TRAINER_PID_ENV. `watch_trainer` (a daemon thread) polls the parent pid: once the trainer
is gone, it kills the replica's whole process group (a vLLM server takes its engine-core and worker
processes with it). The HF replica calls it at start; a vLLM server runs it through the middleware
`--middleware rlflow.engine.rollout.replica_watch.ExitWithTrainer` (which passes every request on).
Without the variable (a replica someone else runs) nothing is watched. Standard library only: vLLM's
environment imports this module.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

TRAINER_PID_ENV = "RLFLOW_TRAINER_PID"
POLL_S = 0.5
log = logging.getLogger("rlflow.replica_watch")
_started = threading.Event()


def watch_trainer(interval_s: float = POLL_S) -> bool:
    """Start the watchdog if a trainer is named (once per process); returns whether one watches."""
    value = os.environ.get(TRAINER_PID_ENV, "")
    if not value.isdigit() or _started.is_set():
        return _started.is_set()
    trainer = int(value)
    _started.set()

    def run() -> None:
        while os.getppid() == trainer:
            time.sleep(interval_s)
        log.error("the trainer process %d is gone; the replica exits", trainer)
        if os.getpgrp() == os.getpid():  # a session of its own (ReplicaProcess): take the helpers along
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(3)

    threading.Thread(target=run, name="trainer-watchdog", daemon=True).start()
    return True


class ExitWithTrainer:
    """ASGI middleware that only starts the watchdog (in the server process, as vLLM builds its app)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        watch_trainer()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
