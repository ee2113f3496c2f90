"""rlflow's HF replica of a model, and a client of it, for the rollout tests."""

from rlflow.engine.rollout.replica import ReplicaClient
from rlflow.engine.rollout.replicas import start_hf_replica


def hf_client(model_dir: str, tokenizer, log_path: str, timeout_s: float = 60.0, **kwargs):
    """(client, replica process): a client owning a fresh one-thread HF replica of `model_dir` (closing
    the client stops the replica)."""
    replica = start_hf_replica(model_dir, threads=1, log_path=log_path, startup_timeout_s=120, timeout_s=timeout_s)
    return replica, ReplicaClient(
        replica.url, replica.key, tokenizer, name="hf-0", run_tag="test", timeout_s=timeout_s,
        on_failure=replica.failure, on_close=replica.close, on_kill=replica.kill, **kwargs,
    )
