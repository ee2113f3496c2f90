"""A training stage as `python -m rlflow.engine.stages.worker` subprocesses (no Prefect), started
with or without an injected fault (RLFLOW_FAULT), and what each run logged."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rlflow.engine.config.schema import build_config
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.secrets import redact
from rlflow.engine.stages.worker import StageCall, write_spec
from rlflow.engine.telemetry.metrics import EVENT_PREFIX


def start_worker(root: Path, tree: dict, call: StageCall, fault: str | None) -> subprocess.Popen:
    """Start the stage in a worker process, on one thread (the reference runs beside the chain)."""
    spec = root / f"spec-{call.stage}.json"
    write_spec(str(spec), redact(build_config(tree, "test").model_dump(mode="json")), call, str(root / "outcome.json"))
    env = dict(os.environ, RLFLOW_SECRETS="{}", OMP_NUM_THREADS="1")
    env.pop("RLFLOW_FAULT", None)
    if fault:  # "<event>:<step>" of this stage, or a whole "<stage>:<event>:<n>" (e.g. the rollout replica's)
        env["RLFLOW_FAULT"] = fault if fault.count(":") == 2 else f"{call.stage}:{fault}"
    command = [sys.executable, "-m", "rlflow.engine.stages.worker", str(spec)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_worker(proc: subprocess.Popen) -> tuple[int, list, str]:
    """Wait for a worker (at most 10 min: a hang fails the test, the worker killed); return (exit code,
    [(step, metrics)] from its event lines, stderr tail)."""
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=60)  # bounded too: a grandchild may hold the pipes
        raise AssertionError(f"the stage worker did not finish within 600 s; its stderr ends:\n{err[-3000:]}") from None
    events = [json.loads(line[len(EVENT_PREFIX) :]) for line in out.splitlines() if line.startswith(EVENT_PREFIX)]
    return proc.returncode, [(e["step"], e["metrics"]) for e in events if e["kind"] == "metrics"], err[-3000:]


VOLATILE = ("timing_s/", "perf/", "checkpoint/")  # metrics that differ between identical runs


def final_files(store_url: str) -> dict[str, str]:
    """{file name: sha256} of the stage's final checkpoint."""
    store = CheckpointStore(store_url)
    final = store.final()
    assert final is not None, f"{store_url} has no final.json"
    store.verify(final["step"])
    return {name: entry["sha256"] for name, entry in store.manifest(final["step"])["files"].items()}


def stable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}
