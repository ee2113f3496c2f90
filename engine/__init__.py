"""The rlflow engine: every training stage on one torch/transformers code path, without Prefect
or MLflow (the flow and its tasks call in; nothing here calls out).

Packages, each on the ones below it (enforced by the import-linter contracts in pyproject.toml):

    estimate     what a run will cost; the probe that measures one real step
    stages       the stage lifecycle, guard and breaker; sft, reward_model, dpo, label/eval, rl/
    rewards      reward sources, the user-function pool, rules, reward-model scores
    rollout      the decode loop, rollout batches, the rollout service and its workers
    backend      torch and DeepSpeed runtimes, collectives, launch, placement, optimizer state
    data         dataset records, prompt encoding, batching
    storage      checkpoints, files, mirror, run lock, export (fsspec)
    models       loading, LoRA, the chunked LM head, token roles, GGUF import
    algorithms | telemetry | tasksets    pure maths | metric sinks and progress | demo and gym tasks
    config       the typed schema, YAML loading, secrets
    envs | promotion    multi-turn environments, tools, parsers, the sandbox | the promotion gates' decision
    seeds | faults | errors
"""
