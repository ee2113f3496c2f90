"""Sampling responses from the policy: the decode loop, rollout batches, and the rollout service
that runs them in this process or in a separate worker process (HF or vLLM) kept in sync with
the trainer's weights.

Owns: generate (RolloutBatch, generate_rollouts), decode, draw, service, server, worker, worker_vllm,
weight_sync.
May import: engine.backend and below.
"""
