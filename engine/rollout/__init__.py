"""Sampling responses from the policy: the decode loop, rollout batches, and the rollout service
that runs them in this process, in an HF worker process, or in a vLLM replica (an HTTP server),
kept in sync with the trainer's weights.

Owns: generate (RolloutBatch, generate_rollouts), decode, draw, service, server, worker, replica,
replica_auth, staging, vllm_replica, vllm_transfer (imported only under vLLM's environment), weight_sync.
May import: engine.backend and below.
"""
