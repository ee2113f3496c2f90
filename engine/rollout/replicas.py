"""The stage's sampler in server mode: rollout replicas, started here or named by rollout.endpoints,
driven through one client (engine/rollout/replica.py) whatever serves them.

    fleet = start_sampler(cfg, model_dir, tokenizer, log_path, cuda_visible_devices)
    generation = fleet.generate(prompts, params, seed)
    fleet.update_weights(policy.named_parameters(), cfg.bucket_mb, version=1)
    fleet.close()                  # stops the replicas started here, gives the trainer its cores back

`rollout.server_backend` picks the server (REPLICA_STARTERS): `hf`, rlflow's transformers replica
(engine/rollout/hf_replica.py; one, with the trainer's thread count, so it samples bit for bit what
colocated generation would), or `vllm`, vLLM's own server (engine/rollout/vllm_replica.py;
`rollout.replicas` of them, each on its own cores). Weights go through shared memory to replicas on
this host, over gloo to `rollout.endpoints`, or through files in `rollout.weights_url` (fsspec).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

from rlflow.engine.backend.launch import free_port
from rlflow.engine.rollout.replica_process import ReplicaProcess

log = logging.getLogger(__name__)


def start_hf_replica(
    model_dir: str,
    *,
    dtype: str = "float32",
    threads: int | None = None,
    host: str = "127.0.0.1",
    log_path: str | None = None,
    startup_timeout_s: float = 300.0,
    timeout_s: float = 600.0,
    trust_remote_code: bool = False,
    cuda_visible_devices: str | None = None,
) -> ReplicaProcess:
    """rlflow's HF replica under this interpreter. threads: its torch threads (default: this
    process's, so both sides compute alike); it exits when this process is gone."""
    import torch

    threads = threads or torch.get_num_threads()
    port = free_port(host)
    command = [sys.executable, "-m", "rlflow.engine.rollout.hf_replica", "--model-dir", str(model_dir)]
    command += ["--host", host, "--port", str(port), "--dtype", dtype, "--threads", str(threads)]
    command += ["--timeout-s", str(timeout_s)]
    command += ["--trust-remote-code"] if trust_remote_code else []
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if cuda_visible_devices is not None:  # placement.rollout: the replica's own GPUs
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return ReplicaProcess.launch(
        command, env, f"http://{host}:{port}", what="HF replica", log_path=log_path,
        startup_timeout_s=startup_timeout_s,
    )


def _start_hf(cfg: Any, model_dir: str, index: int, cores: str | None, log_path: str | None, cuda: str | None):
    return start_hf_replica(
        model_dir, dtype=cfg.dtype, threads=cfg.threads, log_path=log_path, startup_timeout_s=cfg.startup_timeout_s,
        timeout_s=cfg.response_timeout_s, cuda_visible_devices=cuda,
    )


def _start_vllm(cfg: Any, model_dir: str, index: int, cores: str | None, log_path: str | None, cuda: str | None):
    import torch

    from rlflow.engine.rollout.vllm_replica import VLLMOptions, VLLMReplica

    gpu = torch.cuda.is_available()
    options = VLLMOptions(dtype=cfg.dtype, cores=cores, eager=not gpu, chunked_prefill=gpu)
    return VLLMReplica.start(
        model_dir, python=cfg.vllm_python, options=options, startup_timeout_s=cfg.startup_timeout_s,
        log_path=log_path, cuda_visible_devices=cuda,
    )


# rollout.server_backend -> (start one replica, whether it gets cores of its own with rollout.threads)
REPLICA_STARTERS: dict[str, tuple[Callable[..., ReplicaProcess], bool]] = {
    "hf": (_start_hf, False),
    "vllm": (_start_vllm, True),
}


def start_sampler(cfg: Any, model_dir: str, tokenizer: Any, log_path: str | None, cuda_visible_devices: str | None):
    """A ReplicaFleet (engine/rollout/fleet.py) of the rollout.endpoints someone else runs (weights
    over gloo to rollout.trainer_address), or of rollout.replicas servers started here in rollout.dtype
    (weights through shared memory; closing the fleet stops them and gives the trainer its cores back);
    rollout.transport fsspec sends the weights through files in rollout.weights_url instead, a folder
    per replica. A LoRA policy's replicas start from its base: the stage's first sync sends the merged
    weights before anything is sampled. With rollout.partial_rollouts a weight update freezes the
    generations in flight (pause mode keep) and they go on under the new weights, each token tagged
    with its version; otherwise they finish under the old ones (wait)."""
    from rlflow.engine.models.lora import is_lora_dir, lora_base_dir
    from rlflow.engine.rollout.fleet import ReplicaFleet
    from rlflow.engine.rollout.replica import ReplicaClient
    from rlflow.engine.rollout.replica_auth import replica_key

    if cfg.server_backend not in REPLICA_STARTERS:
        valid = sorted(REPLICA_STARTERS)
        raise ValueError(f"unknown rollout.server_backend {cfg.server_backend!r}; use one of {valid}")
    run_tag = f"rlflow-{secrets.token_hex(4)}"  # versions of another start are not this one's
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
    start, own_cores = REPLICA_STARTERS[cfg.server_backend]
    start_from = lora_base_dir(model_dir) if is_lora_dir(model_dir) else model_dir
    cores = [replica_cores(cfg.threads, i, cfg.replicas) if own_cores else None for i in range(cfg.replicas)]
    clients: list = []
    try:
        for i in range(cfg.replicas):
            log_i = log_path if i == 0 else (f"{log_path}.{i}" if log_path else None)
            replica = start(cfg, start_from, i, cores[i], log_i, cuda_visible_devices)
            name = f"{cfg.server_backend}-{i}"
            client = ReplicaClient(
                replica.url, replica.key, name=name, on_failure=replica.failure, on_close=replica.close,
                on_kill=replica.kill, **weights(name), **common,
            )
            clients.append(client)
    except BaseException:
        for client in clients:
            client.close()
        raise
    pinned = None if cfg.threads is None or not own_cores else ",".join(cores)
    return ReplicaFleet(clients, on_close=pin_trainer(pinned))


def replica_cores(threads: int | None, index: int = 0, count: int = 1) -> str | None:
    """Replica `index` of `count`'s `threads` cores, taken from the last ones this process may use
    (`pin_trainer` gives the trainer the others; cores are shared round-robin when there are too
    few); None: the replica's own choice."""
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


