"""Keys that moved to another section, and where: a config written for an earlier rlflow fails on
its first old key with a message naming the new one, never silently falling back to a default."""

from __future__ import annotations

from typing import Any

# old dotted key -> its key now (the one KL section and the sampling section, rlflow issue 17).
MOVED_KEYS = {
    "ppo.kl.controller": "kl.controller",
    "ppo.kl.init_coef": "kl.coef",
    "ppo.kl.target": "kl.target",
    "ppo.kl.horizon": "kl.horizon",
    "ppo.kl.estimator": "kl.estimator",
    "ppo.reference": "kl.reference",
    "ppo.stop_kl": "kl.stop_above",
    "algorithm.use_kl_loss": "kl.in_loss",
    "algorithm.kl_loss_type": "kl.estimator",
    "algorithm.kl_loss_coef": "kl.loss_coef",
    "safety.max_kl": "kl.pause_above",
    "safety.kl_patience": "kl.pause_patience",
    "ppo.temperature": "sampling.temperature",
    "ppo.top_p": "sampling.top_p",
    "ppo.max_new_tokens": "sampling.max_new_tokens",
    "hacking.judge": "reward.judge",
    # rlflow issue 50: the RL loop every estimator shares is rl.*; ppo.* keeps PPO's critic and GAE only.
    **{f"ppo.{key}": f"rl.{key}" for key in (
        "steps", "rollout_batch", "mini_batch", "epochs", "actor_lr", "clip_ratio", "clip_ratio_low",
        "clip_ratio_high", "gamma", "loss_agg", "max_grad_norm", "log_every",
    )},
    "stage.ppo": "stage.rl",
}
# Why a key's meaning is not a plain rename, for the message.
_NOTES = {
    "kl.estimator": "one estimator, used wherever kl.in_loss puts the KL (unset: k1 in the reward, low_var_kl in the loss)",
}


def moved_key_message(loc: tuple[Any, ...], value: Any) -> str | None:
    """'key moved to ...' for an unknown key that an earlier rlflow had; None for any other key.
    An old section (ppo.kl: {...}) is unknown as a whole: the message names the first moved key it
    holds, or every key it had when it holds none."""
    key = ".".join(str(p) for p in loc)
    inner = sorted(old for old in MOVED_KEYS if old.startswith(key + "."))
    given = [old for old in inner if isinstance(value, dict) and old.removeprefix(key + ".") in value]
    if given:
        key = given[0]
    if key in MOVED_KEYS:
        new = MOVED_KEYS[key]
        note = f" ({_NOTES[new]})" if new in _NOTES else ""
        return f"'{key}' moved to '{new}'{note}; rename it there"
    if inner:
        pairs = ", ".join(f"{old.removeprefix(key + '.')} -> {MOVED_KEYS[old]}" for old in inner)
        return f"section '{key}' moved: {pairs}; rename its keys there"
    return None
