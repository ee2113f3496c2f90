"""The maths of RLHF as pure functions: tensors in, tensors out; no I/O, no config objects.

Owns: stats (masked reductions, entropy, log-probs, distinct-n), advantages (GAE and the
critic-free estimators, chosen from ADVANTAGE_ESTIMATORS), kl (penalty and loss estimators,
controllers), losses (per-token PPO and value losses, and how they are averaged), dpo_loss.
May import: torch and engine.errors only.
"""
