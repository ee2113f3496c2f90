"""Sampling responses from the policy: the decode loop, rollout batches, and the rollout service
that runs them in this process or in rollout replicas (HTTP servers: rlflow's HF replica, or vLLM's),
kept in sync with the trainer's weights.

Owns: generate (RolloutBatch, generate_rollouts), decode, draw, service, replicas, replica, fleet,
hf_replica, hf_sampler, replica_process, replica_auth, transfer, transfer_receiver, staging, vllm_replica,
vllm_transfer (imported only under vLLM's environment), weight_sync.
May import: engine.backend and below.
"""
