"""The training stages and their shared lifecycle: resume, the stage guard, fault points,
the checkpoint cadence, the safety breaker and finishing; SFT, the reward model, DPO, labelling
and evaluation, the RL stage (rl/), and the worker that runs any stage on every rank.

Owns: context, lifecycle, guard, breaker, worker, sft, reward_model, dpo, label_eval, evaluation, rl.
May import: engine.rewards, engine.rollout, engine.backend and below.
"""
