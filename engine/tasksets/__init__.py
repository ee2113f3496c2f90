"""Tasks with their own gold rules: the synthetic demo task (data, tokenizer, tiny model),
the arithmetic task, and reasoning-gym's generators and verifiers.

Owns: demo, arith, gym.
May import: engine.errors only.
"""
