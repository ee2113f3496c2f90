"""Callbacks named in configs by reference ("helpers.callbacks:reward_per_token"): found through
sys.path, which pytest's pythonpath setting (pyproject.toml) makes hold tests/."""


def reward_per_token(event):
    return {"custom/reward_per_token": event.metrics["critic/score/mean"] / 4}
