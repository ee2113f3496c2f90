"""Launching a stage as a distributed job, with real launchers and real processes.

The commands are checked with the launchers' own parsers; the supervisor runs real torchrun and
DeepSpeed jobs of the small scripts in dist_scripts/ (imported as top-level modules through
PYTHONPATH), including a two-node rendezvous on 127.0.0.1 with one ZeRO-2 step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from rlflow.engine.config.execution import ResourcesConfig
from rlflow.engine.errors import ConfigError
from rlflow.engine.backend.launch import DistributedJobError, build_launch_command, free_port, rank_env
from rlflow.engine.backend.supervise import run_distributed

SCRIPTS = Path(__file__).parents[3] / "helpers" / "dist_scripts"
# Same folder as the Makefile's: DeepSpeed's shm_comm op (~40 s to build) is compiled once per venv.
EXTENSIONS_DIR = str(Path(sys.prefix) / "torch-extensions")


@pytest.fixture
def hostfile(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "hostfile"
        path.write_text(text)
        return str(path)

    return write


def job_env(nproc: int) -> dict[str, str]:
    env = rank_env(dict(os.environ), nproc, os.cpu_count() or 1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    return env


def torchrun(tmp_path, args: list[str], nproc: int = 2, module: str = "echo_ranks", **resources) -> list[str]:
    config = ResourcesConfig(nproc_per_node=nproc, **resources)
    return build_launch_command(config, module, args, free_port(), log_dir=str(tmp_path / "logs"))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def rank_pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob("*.pid")]


@pytest.fixture(autouse=True)
def children_before():
    """This process's children before the test (session fixtures may own some)."""
    return {child.pid for child in psutil.Process().children(recursive=True)}


def assert_no_processes_left(children_before: set[int], pid_dir: Path | None = None) -> None:
    """No new child of this process, not even a zombie (the launcher was reaped), and every rank
    that wrote its pid is gone."""
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in children_before]
    assert left == []
    for pid in rank_pids(pid_dir) if pid_dir else []:
        assert gone(pid), f"rank process {pid} still running"


# ------------------------------------------------------------------ commands, with the launchers' own parsers


def test_deepspeed_command_for_2_nodes_x_8_gpus_parses_with_deepspeeds_parser(hostfile):
    from deepspeed.launcher.runner import (
        apply_num_nodes_and_gpus,
        fetch_hostfile,
        parse_args,
        parse_inclusion_exclusion,
    )

    path = hostfile("# two nodes\nworker-0 slots=8\n\nworker-1 slots=8  # trailing note\n")
    resources = ResourcesConfig(nproc_per_node=8, nnodes=2, hostfile=path, master_addr="10.0.0.5", launcher="deepspeed")
    cmd = build_launch_command(resources, "rlflow.engine.stages.worker", ["spec.json", "--x=1"], 29555)
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    args = parse_args(cmd[3:])
    assert (args.hostfile, args.num_nodes, args.num_gpus) == (path, 2, 8)
    assert (args.master_addr, args.master_port) == ("10.0.0.5", 29555)
    assert args.module and args.no_local_rank and not args.no_ssh_check
    assert (args.user_script, args.user_args) == ("rlflow.engine.stages.worker", ["spec.json", "--x=1"])
    pool = fetch_hostfile(args.hostfile)
    assert pool == {"worker-0": 8, "worker-1": 8}
    active = apply_num_nodes_and_gpus(parse_inclusion_exclusion(pool, "", ""), args.num_nodes, args.num_gpus)
    assert {host: len(slots) for host, slots in active.items()} == {"worker-0": 8, "worker-1": 8}  # world size 16


def test_deepspeed_single_node_needs_no_hostfile():
    from deepspeed.launcher.runner import parse_args

    cmd = build_launch_command(ResourcesConfig(nproc_per_node=2, launcher="deepspeed"), "m", [], 1234)
    assert "--hostfile" not in cmd
    args = parse_args(cmd[3:])
    assert (args.num_nodes, args.num_gpus, args.master_port, args.user_script) == (1, 2, 1234, "m")


def test_deepspeed_single_node_on_a_gpu_subset_names_those_gpus():
    """DeepSpeed's runner drops CUDA_VISIBLE_DEVICES when --num_gpus is given (it would run on GPUs
    0..N-1): with the job's CUDA_VISIBLE_DEVICES the command uses --include for exactly those."""
    from deepspeed.launcher.runner import parse_args, parse_inclusion_exclusion

    resources = ResourcesConfig(nproc_per_node=2, launcher="deepspeed")
    cmd = build_launch_command(resources, "m", ["a"], 1234, cuda_visible_devices="2,3")
    args = parse_args(cmd[3:])
    assert (args.include, args.num_nodes, args.num_gpus, args.user_args) == ("localhost:2,3", -1, -1, ["a"])
    assert parse_inclusion_exclusion({"localhost": 4}, args.include, "") == {"localhost": [2, 3]}
    assert "--include" not in build_launch_command(resources, "m", [], 1, cuda_visible_devices="")  # CPU
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='1,2,3' lists 3 GPU\(s\) but .*nproc_per_node=2"):
        build_launch_command(resources, "m", [], 1, cuda_visible_devices="1,2,3")
    with pytest.raises(ConfigError, match=r"not UUIDs"):
        build_launch_command(resources, "m", [], 1, cuda_visible_devices="GPU-1a2b,GPU-3c4d")


def test_torchrun_command_for_2_nodes_x_8_gpus_parses_with_torchs_parser(tmp_path, monkeypatch):
    from torch.distributed.run import config_from_args, get_args_parser

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it in this process otherwise
    resources = ResourcesConfig(nproc_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.5", master_port=29555)
    cmd = build_launch_command(resources, "rlflow.engine.stages.worker", ["spec.json"], 29555, log_dir=str(tmp_path))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(cmd[3:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert (args.master_addr, args.master_port, args.rdzv_backend) == ("10.0.0.5", 29555, "static")
    assert (args.module, args.training_script, args.training_script_args) == (
        True,
        "rlflow.engine.stages.worker",
        ["spec.json"],
    )
    assert (args.tee, args.max_restarts, args.log_dir) == ("3", 0, str(tmp_path))
    config, _, worker_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert config.rdzv_endpoint == "10.0.0.5:29555" and config.rdzv_configs["rank"] == 1
    assert worker_args == ["-u", "-m", "rlflow.engine.stages.worker", "spec.json"]


BAD_HOSTFILES = {
    "malformed line": ("worker-0 slots=8\nworker-1 gpus=8\n", r"hostfile:2: bad hostfile line 'worker-1 gpus=8'"),
    "duplicate host": ("worker-0 slots=8\n# c\nworker-0 slots=8\n", r"hostfile:3: host 'worker-0' is listed twice"),
    "too few slots": ("worker-0 slots=8\nworker-1 slots=4\n", r"hostfile:2: host 'worker-1' has slots=4 but .*=8"),
    "wrong host count": ("worker-0 slots=8\n", r"hostfile: lists 1 host\(s\) but resources.nnodes=2"),
    "empty": ("# nothing\n\n", r"hostfile: lists 0 host\(s\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_HOSTFILES))
def test_bad_hostfile_is_a_config_error_naming_file_and_line(case, hostfile):
    text, pattern = BAD_HOSTFILES[case]
    resources = ResourcesConfig(nproc_per_node=8, nnodes=2, hostfile=hostfile(text), launcher="deepspeed")
    with pytest.raises(ConfigError, match=pattern) as info:
        build_launch_command(resources, "m", [], 1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "resources, pattern",
    [
        ({"hostfile": "/nonexistent/hosts", "launcher": "deepspeed"}, r"resources.hostfile '/nonexistent/hosts' not"),
        ({"nnodes": 2, "launcher": "deepspeed"}, r"resources.nnodes=2 with launcher deepspeed needs resources.hostf"),
        ({"nnodes": 2, "node_rank": 1, "launcher": "deepspeed"}, r"resources.node_rank=1 with launcher deepspeed"),
        ({"hostfile": "h", "launcher": "torchrun"}, r"resources.hostfile='h' is read only by launcher deepspeed"),
        ({"nnodes": 2, "node_rank": 2}, r"resources.node_rank=2 must be below resources.nnodes=2"),
        ({"nnodes": 2}, r"resources.nnodes=2 with launcher torchrun needs resources.master_port"),
    ],
)
def test_inconsistent_resources_are_config_errors(resources, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_launch_command(ResourcesConfig(**resources), "m", [], 1)


def test_rank_env_sets_threads_per_rank_unless_the_user_did():
    assert rank_env({"A": "1"}, 2, 2) == {"A": "1", "OMP_NUM_THREADS": "1"}
    assert rank_env({}, 2, 16)["OMP_NUM_THREADS"] == "8"
    assert rank_env({}, 8, 2)["OMP_NUM_THREADS"] == "1"
    assert rank_env({"OMP_NUM_THREADS": "3"}, 2, 2)["OMP_NUM_THREADS"] == "3"


def test_free_port_can_be_bound():
    import socket

    port = free_port()
    assert 1024 <= port < 65536  # the OS's ephemeral range, never a privileged port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if the port were taken
        assert s.getsockname()[1] == port
        assert free_port() != port  # while it is held, it is not handed out again


# ------------------------------------------------------------------ real jobs


def collect() -> tuple[list[tuple[int | None, str]], Callable[[int | None, str], None]]:
    """(the lines seen, an on_line callback that appends (rank, text) to them)."""
    lines: list[tuple[int | None, str]] = []
    return lines, lambda rank, text: lines.append((rank, text))


def test_failing_rank_is_named_even_when_its_peer_exits_first(tmp_path, children_before):
    """Rank 1 raises and takes 3 s to tear down; rank 0 fails 50 ms after the error the way a
    peer of a failed rank does and exits first. torchrun's summary blames rank 0 (the first exit
    it saw); the failure records name rank 1, and its exit code is its error's, not the SIGTERM
    torchrun then sent it."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    lines, on_line = collect()
    args = ["--fail-rank", "1", "--peer-follows", "--pid-dir", str(pid_dir)]
    with pytest.raises(DistributedJobError) as info:
        run_distributed(torchrun(tmp_path, args), job_env(2), on_line, timeout_s=60)
    error = info.value
    assert (error.rank, error.exit_code) == (1, 1)
    message = str(error)
    assert message.startswith("distributed job failed: rank 1 exited with code 1 (ValueError: boom on rank 1)")
    tail = message.splitlines()[1:]
    assert "  | ValueError: boom on rank 1" in tail and any("Traceback" in line for line in tail)
    assert not any("Connection closed by peer" in line for line in tail)  # rank 0's error is not shown
    assert (0, "RuntimeError: Connection closed by peer (simulated): a remote worker crashed") in lines
    launcher = [text for rank, text in lines if rank is None]
    root_cause = launcher.index("Root Cause (first observed failure):")
    assert next(t for t in launcher[root_cause:] if t.strip().startswith("rank ")).split()[2] == "0"
    assert_no_processes_left(children_before, pid_dir)


def test_torchrun_job_streams_lines_with_global_ranks_and_names_a_rank_that_died_hard(tmp_path, children_before):
    """Every line arrives, as it comes, with its rank; rank 1 then ends with os._exit(7): no
    exception, no failure record, so torchrun's summary is the witness. (The two-node test below
    covers a job that succeeds.)"""
    lines, on_line = collect()
    with pytest.raises(DistributedJobError) as info:
        run_distributed(torchrun(tmp_path, ["--fail-rank", "1", "--hard", "7"]), job_env(2), on_line, 60)
    assert (0, "hello from rank 0 of 2 omp=1") in lines and (1, "hello from rank 1 of 2 omp=1") in lines
    assert (0, "stderr of rank 0") in lines and (1, "stderr of rank 1") in lines
    assert (0, '@@rlflow-event {"event": "ready", "world_size": 2}') in lines
    assert lines.index((0, "hello from rank 0 of 2 omp=1")) < lines.index((0, "rank 0 done"))
    assert (info.value.rank, info.value.exit_code) == (1, 7)
    assert str(info.value).startswith(
        "distributed job failed: rank 1 exited with code 7 (died without a Python exception: killed, out of memory, or os._exit);"
    )
    assert sorted(info.value.tail) == ["hello from rank 1 of 2 omp=1", "stderr of rank 1"]  # stdout, stderr: 2 files
    assert_no_processes_left(children_before)


def test_timeout_kills_the_process_group(tmp_path, children_before):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    start = time.monotonic()
    cmd = torchrun(tmp_path, ["--sleep", "300", "--pid-dir", str(pid_dir)])
    with pytest.raises(DistributedJobError, match=r"timed out after 15 s") as info:
        # the ranks start in ~2.5 s on idle cores; 15 s leaves room for a loaded machine
        run_distributed(cmd, job_env(2), lambda rank, text: None, timeout_s=15)
    assert "  | [rank 1] hello from rank 1 of 2 omp=1" in str(info.value)
    assert time.monotonic() - start < 60
    assert len(rank_pids(pid_dir)) == 2  # the ranks had started
    assert_no_processes_left(children_before, pid_dir)


def test_keyboard_interrupt_kills_the_process_group(tmp_path, children_before):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def on_line(rank: int | None, text: str) -> None:
        if len(rank_pids(pid_dir)) == 2 and text.startswith("hello from rank"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_distributed(torchrun(tmp_path, ["--sleep", "60", "--pid-dir", str(pid_dir)]), job_env(2), on_line, 60)
    assert_no_processes_left(children_before, pid_dir)


def test_sigterm_to_the_supervisor_kills_the_process_group(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    cmd = torchrun(tmp_path, ["--sleep", "60", "--pid-dir", str(pid_dir)])
    supervisor = (
        "import json, sys\nfrom rlflow.engine.backend.supervise import run_distributed\n"
        "run_distributed(json.loads(sys.argv[1]), json.loads(sys.argv[2]), lambda r, t: None)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", supervisor, json.dumps(cmd), json.dumps(job_env(2))])
    try:
        deadline = time.monotonic() + 30
        while len(rank_pids(pid_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(rank_pids(pid_dir)) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    for pid in rank_pids(pid_dir):
        assert gone(pid), f"rank process {pid} survived the supervisor's SIGTERM"


def test_deepspeed_launcher_on_cpu_names_the_failing_rank_from_its_record(tmp_path, children_before):
    """DeepSpeed's runner prefixes nothing: every line arrives with rank None, and the failing
    rank and its traceback come from the failure records."""
    lines, on_line = collect()
    cmd = build_launch_command(
        ResourcesConfig(nproc_per_node=2, launcher="deepspeed"), "echo_ranks", ["--fail-rank", "1", "--peer-follows"],
        free_port(),
    )  # fmt: skip
    with pytest.raises(DistributedJobError) as info:
        run_distributed(cmd, job_env(2), on_line, timeout_s=90)
    assert (info.value.rank, info.value.exit_code) == (1, 1)
    assert "(ValueError: boom on rank 1)" in str(info.value).splitlines()[0]
    assert "  | ValueError: boom on rank 1" in str(info.value)
    assert (None, "hello from rank 1 of 2 omp=1") in lines
    assert (None, '@@rlflow-event {"event": "ready", "world_size": 2}') in lines
    assert {rank for rank, _ in lines} == {None}
    assert_no_processes_left(children_before)


def test_two_nodes_rendezvous_and_agree_after_one_zero2_step(tmp_path, children_before):
    """Two torchrun launchers (node_rank 0 and 1, one process each) on 127.0.0.1 form one world
    of 2; after one ZeRO-2 AdamW step both ranks hold the same weights, equal to one full-batch
    step of a single process over both ranks' data."""
    import torch

    sys.path.insert(0, str(SCRIPTS))
    try:
        import ddp_one_step as job
    finally:
        sys.path.remove(str(SCRIPTS))

    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    lines: dict[int, list[tuple[int | None, str]]] = {0: [], 1: []}
    errors: dict[int, BaseException] = {}

    def node(node_rank: int) -> None:
        resources = ResourcesConfig(nproc_per_node=1, nnodes=2, node_rank=node_rank, master_port=port)
        cmd = build_launch_command(resources, "ddp_one_step", [str(out)], port, log_dir=str(tmp_path / "logs"))
        try:
            run_distributed(cmd, job_env(1), lambda r, t: lines[node_rank].append((r, t)), timeout_s=240)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors[node_rank] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == {}, errors
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert [(results[r]["rank"], results[r]["world_size"], results[r]["node_rank"]) for r in (0, 1)] == [
        (0, 2, 0),
        (1, 2, 1),
    ]
    # Each node's lines carry its global rank: node 1's only rank is rank 1, not local rank 0.
    assert any(r == 0 and t.startswith("rank 0/2 stepped") for r, t in lines[0])
    assert any(r == 1 and t.startswith("rank 1/2 stepped") for r, t in lines[1])

    def one_step(batches: list) -> list[float]:
        model = job.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=job.LR)
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches) / len(batches)
        loss.backward()
        optimizer.step()
        return job.flat_params(model)

    both, only_rank0 = one_step([job.make_batch(0), job.make_batch(1)]), one_step([job.make_batch(0)])
    assert results[0]["params"] == results[1]["params"]
    assert max(abs(a - b) for a, b in zip(results[0]["params"], both)) < 1e-6
    assert max(abs(a - b) for a, b in zip(both, only_rank0)) > 1e-3  # the check can tell averaged gradients apart
    assert_no_processes_left(children_before)
