"""The maths of RLHF as pure functions: tensors in, tensors out; no I/O, no config objects.

Owns: stats (masked reductions, entropy, log-probs, distinct-n), advantages (GAE and the
critic-free estimators, chosen from ADVANTAGE_ESTIMATORS), kl (penalty and loss estimators,
controllers), policy_losses (PPO, GSPO, CISPO: POLICY_LOSSES), rollout_correction (the sampler's
importance weights: TIS, MIS), losses (the value loss, and how per-token losses are averaged),
dpo_loss.
May import: torch and engine.errors only.
"""
