"""Rewards: the configured reward sources (reward model, rules, verifiers, user functions),
the sandboxed process pool that runs user functions with timeouts, the built-in rules, and the
reward-model scoring used by RL and evaluation.

Owns: sources, pool, rules, user_functions, model_scores.
May import: engine.rollout, engine.tasksets and below.
"""
