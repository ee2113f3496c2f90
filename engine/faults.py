"""Fault injection for kill, hang and failure tests: RLFLOW_FAULT names one event to fail at.

``RLFLOW_FAULT="<stage>:<event>:<step>"``, e.g. ``rl:update:3``. Points are placed in the stage
loops and the checkpoint store; a test sets the variable for one subprocess and never sleeps.
What happens at a matching point depends on the event (``EVENTS``): most die at once like a
SIGKILL (``os._exit``: no cleanup, no atexit, no flushing of Python buffers).
"""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "RLFLOW_FAULT"
FAULT_ONCE_ENV = "RLFLOW_FAULT_ONCE"
KILLED_EXIT_CODE = 137  # what a shell reports for SIGKILL; the launcher blames such a rank first

# event -> where it fires (the README's kill-point table lists the kill events)
EVENTS = {
    "step": "start of the step, before any work",
    "rollout": "PPO: after the first rollout chunk is sampled, before the rest",
    "update": "after the step's optimizer update(s), before the step ends (engine/stages/loop.py)",
    "ckpt_files": "checkpoint: optimizer shards written, training state and manifest not",
    "ckpt_inside": "checkpoint: half of the step's first file written and flushed",
    "disk_full": "checkpoint: the step's first file write raises OSError(ENOSPC); the stage fails, no death",
    "ckpt_manifest": "checkpoint: manifest committed, older steps not yet pruned",
    "before_final": "stage end: last checkpoint committed, final.json not written",
    "after_final": "stage end: final.json written (the next stage has not started)",
    "sigterm": "start of the step: the process sends itself SIGTERM (preemption) and goes on",
    "hang": "start of the step: the stage blocks forever (the watchdog's test)",
    "reward_error": "PPO: the reward source raises RewardSourceError at scoring",
    "batch_received": "PPO: the step's batch sampled and scored, no update yet",
    "weight_sync": "PPO, rollout.mode server: the first tensor of the actor's weights sent to the worker",
    "generate": "the HF rollout replica (stage 'rollout', n: its n-th batch), before sampling",
    "replica_kill": "vLLM replicas (stage 'rollout', n: the fleet's n-th generate call): the replicas rlflow"
    " started are SIGKILLed, then the rows are sent",
    "nonfinite": "the step's loss becomes NaN",
    "alias": "promotion (step: the round): the version's promotion tags set, the champion alias not moved",
}


def armed(stage: str, event: str, step: int) -> bool:
    """Whether RLFLOW_FAULT names this point. With RLFLOW_FAULT_ONCE=<file>, only the first time
    over all processes (the file records that it fired): a retried stage then runs through."""
    if os.environ.get(FAULT_ENV) != f"{stage}:{event}:{step}":
        return False
    marker = os.environ.get(FAULT_ONCE_ENV)
    if marker:
        try:
            with open(marker, "x"):
                pass
        except FileExistsError:
            return False
    return True


def die() -> None:
    os._exit(KILLED_EXIT_CODE)


def fault_point(stage: str, event: str, step: int) -> None:
    """Act on a matching RLFLOW_FAULT: die, hang, or signal preemption (see EVENTS)."""
    if not armed(stage, event, step):
        return
    if event == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif event == "hang":
        while True:  # stuck Python code (a stuck native call is what the watchdog's exit is for)
            time.sleep(0.05)
    else:
        die()
