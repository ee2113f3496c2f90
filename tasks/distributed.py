"""Running a training stage as a distributed job from a Prefect task (engine.backend: deepspeed).

The task writes a spec, starts the launcher (torchrun or DeepSpeed's) with `rlflow.engine.stages.worker`
on every rank, streams the ranks' output into the task's logger, replays rank 0's metric events
into the stage's sinks (console, MLflow), and reads rank 0's outcome back. Any rank failing
raises DistributedJobError with that rank's last log lines, which fails the task.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from rlflow.engine.config.schema import Config
from rlflow.engine.config.secrets import REDACTED, secret_strings, split_secrets
from rlflow.engine.backend.launch import DistributedJobError, build_launch_command, free_port, rank_env
from rlflow.engine.backend.supervise import run_distributed
from rlflow.engine.telemetry.metrics import MetricsSink, replay_event
from rlflow.engine.backend.placement import devices_for
from rlflow.engine.errors import StagePreempted
from rlflow.engine.stages.context import StageOutcome
from rlflow.engine.stages.worker import StageCall, write_spec
from rlflow.engine.config.secrets import SECRETS_ENV

WORKER_MODULE = "rlflow.engine.stages.worker"


def secret_values(secret_tree: Any) -> list[str]:
    """Every secret string in the tree, and the JSON the ranks receive: masked in their log lines."""
    values = secret_strings(secret_tree) + ([json.dumps(secret_tree)] if secret_tree else [])
    return sorted(set(values), key=len, reverse=True)  # longest first: no partial masks


def launch_training_stage(config: Config, call: StageCall, sink: MetricsSink, logger: Any) -> StageOutcome:
    """Run `call` on `config.resources` ranks; return rank 0's outcome."""
    resources = config.resources
    public, secret = split_secrets(config.model_dump(mode="json"))
    with tempfile.TemporaryDirectory(prefix=f"rlflow-{call.stage}-") as work, _exchange(config, call, work) as base:
        spec_path, outcome_path = f"{base}/spec.json", f"{base}/outcome.json"
        write_spec(spec_path, public, call, outcome_path, config.run.storage_options)
        devices = devices_for(config.placement.train, os.environ.get("CUDA_VISIBLE_DEVICES"))
        devices = devices if devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
        command = build_launch_command(
            resources,
            WORKER_MODULE,
            [spec_path],
            resources.master_port or free_port(),
            log_dir=os.path.join(work, "logs"),
            cuda_visible_devices=devices,
        )
        env = rank_env(dict(os.environ), resources.nproc_per_node, os.cpu_count() or 1)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices  # placement.train
        env[SECRETS_ENV] = json.dumps(secret)  # the environment, never the spec file or argv
        logger.info(
            "round %d %s: launching %d rank(s): %s",
            call.round_index,
            call.stage,
            resources.world_size,
            " ".join(command),
        )

        hidden = secret_values(secret)

        def on_line(rank: int | None, text: str) -> None:
            if not replay_event(text, sink) and text.strip():
                for value in hidden:  # e.g. DeepSpeed's runner logs the `export K=V` it runs on other nodes
                    text = text.replace(value, REDACTED)
                logger.info("[rank %s] %s", "?" if rank is None else rank, text)

        try:
            run_distributed(command, env, on_line, preempt_grace_s=config.checkpoint.preempt_grace_s)
        except DistributedJobError as exc:
            if exc.exit_code == StagePreempted.exit_code:  # the ranks obeyed a SIGTERM after a checkpoint
                last = exc.tail[-1] if exc.tail else str(exc)
                raise StagePreempted(f"round {call.round_index} {call.stage}: {last}") from None
            raise
        with fsspec.open(outcome_path, "r", **config.run.storage_options) as f:
            return StageOutcome.model_validate_json(f.read())


@contextlib.contextmanager
def _exchange(config: Config, call: StageCall, local_dir: str) -> Iterator[str]:
    """Where the spec and rank 0's outcome live: this machine's temp dir for a one-node job; under
    run.root for a multi-node one (every node reads the spec, and rank 0 may be on another host).
    The run.root folder is removed afterwards."""
    if config.resources.nnodes == 1:
        yield local_dir
        return
    job = f"round_{call.round_index}-{call.stage}-{uuid.uuid4().hex[:8]}"
    base = f"{config.run.root.rstrip('/')}/{config.run.name}/.launch/{job}"
    fs, path = url_to_fs(base, **config.run.storage_options)
    try:
        yield base
    finally:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)
