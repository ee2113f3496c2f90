"""The stages and their shared lifecycle: each stage's inputs record and identity, resume, the stage
guard, fault points, the checkpoint cadence, the safety breaker and finishing; SFT, online labels,
the reward model, DPO, the RL stage (rl/) and the round's evaluation, the catalog of them all, and
the worker that runs any stage on every rank.

Owns: context, inputs, identity, catalog, lifecycle, loop, guard, breaker, worker, sft, label, reward_model,
dpo, evaluation (measuring one policy), round_eval, rl.
May import: engine.rewards, engine.rollout, engine.backend and below.
"""
