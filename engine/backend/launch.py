"""Launching one stage as a distributed job: the launcher command, the rank environment and the
resource checks (the supervisor that runs it: engine/backend/supervise.py).

The command is `<launcher> ... -m <module> <args>`, the launcher being torchrun (one launcher per
node, `--node_rank` tells them apart) or DeepSpeed's runner (one launcher on node 0 that reaches
the other hosts of a hostfile over pdsh/ssh). See infra/multinode.md.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rlflow.engine.config.execution import ResourcesConfig
from rlflow.engine.errors import ConfigError, RlflowError

DEFAULT_TORCHRUN_LOG_DIR = Path(tempfile.gettempdir()) / "rlflow-torchrun-logs"


class DistributedJobError(RlflowError):
    """A distributed job exited non-zero (or timed out); names the failing global rank, its exit
    code and that rank's last log lines."""

    def __init__(
        self, message: str, rank: int | None = None, exit_code: int | None = None, tail: list[str] | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank  # global rank; None when it could not be told
        self.exit_code = exit_code  # negative: killed by that signal
        self.tail = tail or []  # the failing rank's last log lines (also in the message)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS may hand it out again later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(base_env: dict[str, str], nproc_per_node: int, cpu_count: int) -> dict[str, str]:
    """A copy of `base_env` with OMP_NUM_THREADS = cores per rank (at least 1) unless already set:
    ranks sharing a node's cores would otherwise each start one OpenMP thread per core."""
    env = dict(base_env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count // max(1, nproc_per_node))))
    return env


# ---------------------------------------------------------------------------------------------
# The launcher command


def read_hostfile(path: str, nnodes: int, nproc_per_node: int) -> dict[str, int]:
    """{host: slots} of a DeepSpeed/MPI hostfile ("host slots=N" lines, '#' comments), parsed by
    DeepSpeed's own parser line by line so an error names the line; the first `nnodes` hosts are
    used, so the file must list exactly `nnodes` hosts with at least `nproc_per_node` slots each."""
    from deepspeed.launcher.runner import _parse_hostfile, fetch_hostfile
    from deepspeed.utils import logger as ds_logger

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"resources.hostfile {path!r} not found: give the path of a 'host slots=N' file")
    seen: dict[str, int] = {}
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            with _quiet(ds_logger):  # it logs the whole file at ERROR before raising; our message says it all
                ((host, slots),) = _parse_hostfile([text]).items()
        except ValueError:
            raise ConfigError(
                f"{path}:{number}: bad hostfile line {text!r}: write 'hostname slots=N' (see infra/hostfile.example)"
            ) from None
        if host in seen:
            raise ConfigError(f"{path}:{number}: host {host!r} is listed twice (first on line {seen[host]})")
        if slots < nproc_per_node:
            raise ConfigError(
                f"{path}:{number}: host {host!r} has slots={slots} but resources.nproc_per_node={nproc_per_node}:"
                " raise its slots or lower nproc_per_node"
            )
        seen[host] = number
    if len(seen) != nnodes:
        raise ConfigError(
            f"{path}: lists {len(seen)} host(s) but resources.nnodes={nnodes}: list exactly one line per node"
        )
    pool = fetch_hostfile(path)  # DeepSpeed's whole-file view: what its runner will use
    return dict(pool or {})


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_resources(resources: ResourcesConfig) -> None:
    """ConfigError unless `resources` can be launched: node_rank < nnodes, multi-node torchrun has a
    fixed master_port, a hostfile only with launcher deepspeed (and valid), deepspeed with
    nnodes > 1 has a hostfile and node_rank 0. Cheap unless a hostfile is set (imports DeepSpeed)."""
    if resources.node_rank >= resources.nnodes:
        raise ConfigError(
            f"resources.node_rank={resources.node_rank} must be below resources.nnodes={resources.nnodes}"
        )
    if resources.launcher == "torchrun" and resources.nnodes > 1 and resources.master_port is None:
        raise ConfigError(
            f"resources.nnodes={resources.nnodes} with launcher torchrun needs resources.master_port: every node's"
            " launcher must meet node 0 on the same port (e.g. 29500, open between the nodes)"
        )
    if resources.launcher == "torchrun" and resources.hostfile is not None:
        raise ConfigError(
            f"resources.hostfile={resources.hostfile!r} is read only by launcher deepspeed: torchrun runs one launcher"
            " per node (set resources.node_rank on each) - remove the hostfile or set resources.launcher=deepspeed"
        )
    if resources.launcher == "deepspeed":
        if resources.node_rank != 0:
            raise ConfigError(
                f"resources.node_rank={resources.node_rank} with launcher deepspeed: its runner starts every node"
                " from node 0 over pdsh/ssh - set resources.node_rank=0 or use resources.launcher=torchrun"
            )
        if resources.nnodes > 1 and resources.hostfile is None:
            raise ConfigError(
                f"resources.nnodes={resources.nnodes} with launcher deepspeed needs resources.hostfile listing the"
                " hosts (see infra/hostfile.example)"
            )
        if resources.hostfile is not None:
            read_hostfile(resources.hostfile, resources.nnodes, resources.nproc_per_node)


def _deepspeed_local_include(resources: ResourcesConfig, cuda_visible_devices: str | None) -> list[str]:
    """`--include localhost:<ids>` for a one-node DeepSpeed job on a subset of GPUs. DeepSpeed's
    runner deletes CUDA_VISIBLE_DEVICES when --num_gpus is given and then runs on GPUs 0..N-1,
    whatever was visible; with --include it sets CUDA_VISIBLE_DEVICES to exactly these ids."""
    ids = [part.strip() for part in (cuda_visible_devices or "").split(",") if part.strip()]
    if not ids or resources.hostfile is not None:
        return []
    if not all(part.isdigit() for part in ids):
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: DeepSpeed's launcher takes integer GPU ids, not UUIDs -"
            " use integer ids or resources.launcher=torchrun"
        )
    if len(ids) != resources.nproc_per_node:
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} lists {len(ids)} GPU(s) but resources.nproc_per_node="
            f"{resources.nproc_per_node}: the deepspeed launcher runs one rank per visible GPU - make them match"
        )
    return ["--include", f"localhost:{','.join(ids)}"]


def build_launch_command(
    resources: ResourcesConfig,
    module: str,
    args: list[str],
    master_port: int,
    log_dir: str | None = None,
    cuda_visible_devices: str | None = None,
) -> list[str]:
    """The argv that runs `python -m module *args` on every rank of `resources`. `master_port`:
    resources.master_port when set (required, and the same on every node, for multi-node torchrun),
    else a free_port().

    torchrun: `--tee 3` copies each rank's stdout/stderr to the console with a "[rank<global>]:"
    prefix (set by run_distributed through TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE) and keeps them as
    files under `log_dir` (default: a folder in the system temp dir), `<log_dir>/<run>/attempt_0/
    <local_rank>/std{out,err}.log`. `--max_restarts 0`: a failed stage is retried by the
    orchestrator from its last checkpoint, not by torchrun from scratch.

    deepspeed: DeepSpeed's runner; `--no_local_rank` because ranks read LOCAL_RANK from the
    environment. Without a hostfile it runs on this node (also CPU-only: `--num_gpus` processes);
    note that it then reads /job/hostfile if that exists, as DeepSpeed always does. Pass the job's
    `cuda_visible_devices` when it runs on GPUs: on one node without a hostfile the command then
    names those GPUs (`--include localhost:<ids>`, see _deepspeed_local_include) instead of
    `--num_nodes/--num_gpus`. With a one-host hostfile `--no_ssh_check` skips its ssh probe (the
    launch is local anyway).
    Raises ConfigError for a missing/malformed hostfile or inconsistent resources.
    """
    check_resources(resources)
    r = resources
    if r.launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(r.nnodes), "--nproc_per_node", str(r.nproc_per_node), "--node_rank", str(r.node_rank),
            "--master_addr", r.master_addr, "--master_port", str(master_port),
            "--max_restarts", "0", "--tee", "3", "--log_dir", str(log_dir or DEFAULT_TORCHRUN_LOG_DIR),
            "-m", module, *args,
        ]  # fmt: skip
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if r.hostfile is not None:
        cmd += ["--hostfile", r.hostfile]
        if r.nnodes == 1:
            cmd.append("--no_ssh_check")
    include = _deepspeed_local_include(r, cuda_visible_devices) if r.nnodes == 1 else []
    cmd += include or ["--num_nodes", str(r.nnodes), "--num_gpus", str(r.nproc_per_node)]
    cmd += ["--master_addr", r.master_addr, "--master_port", str(master_port), "--no_local_rank", "--module", module]
    return [*cmd, *args]
