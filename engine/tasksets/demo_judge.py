"""The demo's independent judge: a second pool of raters, fitted as a bag-of-words reward model.

The round's reward model is a transformer trained on one pool's labels. An independent judge must
not share its blind spots, so this one differs in both: its labels come from another pool (other
pairs, more rater noise) and its model is linear in word frequencies (a Bradley–Terry model whose
score is sum over words of weight x the word's share of the answer). It never reads the gold rule:
it knows only which of two answers its raters preferred. What it cannot know, it does not score:
words its raters never saw (a stray BPE fragment) weigh 0, and its pairs are all 5–13 words long,
so its (linear) length weight is an extrapolation beyond them. Declared as a reward source of
weight 0 (`reward.judge`), it is what the hacking detector and the judge gates compare the reward model with.

`second_rater_record` fits it when the demo assets are written; `second_rater` is the reward function.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any

JUDGE_FILE = "judge/second_rater.json"  # under the demo assets' folder
LENGTH_FEATURE = "<words/10>"  # the answer's length in words / 10: a feature, so length preferences can be learned


def judge_features(response: str) -> dict[str, float]:
    """The judge's features of one answer: each word's share of its words, and its length / 10."""
    words = response.split()
    if not words:
        return {LENGTH_FEATURE: 0.0}
    counts = Counter(words)
    return {w: c / len(words) for w, c in counts.items()} | {LENGTH_FEATURE: len(words) / 10}


def score_with(weights: dict[str, float], response: str) -> float:
    """The judge's score of an answer (logit units: a difference of 1 is odds e:1 of being preferred)."""
    return sum(weights.get(f, 0.0) * v for f, v in judge_features(response).items())


def fit_second_rater(pairs: list[dict[str, str]], l2: float = 1e-3, steps: int = 100) -> dict[str, float]:
    """Bradley–Terry weights over judge_features from {chosen, rejected} pairs: minimise the mean of
    softplus(-(score(chosen) - score(rejected))) + l2 x |w|^2 (convex; L-BFGS, deterministic)."""
    import torch

    names = sorted({f for p in pairs for side in ("chosen", "rejected") for f in judge_features(p[side])})
    index = {n: i for i, n in enumerate(names)}

    def matrix(side: str) -> torch.Tensor:
        x = torch.zeros(len(pairs), len(names), dtype=torch.float64)
        for row, p in enumerate(pairs):
            for f, v in judge_features(p[side]).items():
                x[row, index[f]] = v
        return x

    diff = matrix("chosen") - matrix("rejected")  # [pairs, features]
    w = torch.zeros(len(names), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.softplus(-(diff @ w)).mean() + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return {n: float(v) for n, v in zip(names, w.detach()) if abs(float(v)) > 1e-9}


def pair_accuracy(weights: dict[str, float], pairs: list[dict[str, str]]) -> float:
    """Share of pairs whose chosen answer the judge scores higher (ties count half)."""
    if not pairs:
        return float("nan")
    wins = 0.0
    for p in pairs:
        margin = score_with(weights, p["chosen"]) - score_with(weights, p["rejected"])
        wins += 1.0 if margin > 0 else 0.5 if margin == 0 else 0.0
    return wins / len(pairs)


def second_rater_record(pairs: list[dict[str, str]], held_out: list[dict[str, str]], noise: float) -> dict:
    """Fit the judge on its raters' pairs: {weights, pairs, rater_noise, held_out_accuracy}, the
    JSON record `second_rater` reads."""
    weights = fit_second_rater(pairs)
    return {
        "weights": weights,
        "pairs": len(pairs),
        "rater_noise": noise,
        "held_out_accuracy": pair_accuracy(weights, held_out),
    }


@functools.cache
def _load_weights(path: str) -> dict[str, float]:
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the demo judge's weights {path} do not exist: "
            "write the demo assets first (rlflow demo-assets demo_assets)"
        ) from None
    return {str(k): float(v) for k, v in record["weights"].items()}


def second_rater(prompt: str, response: str, *, weights: str, **fields: Any) -> float:
    """The judge as a reward function: `weights` is the JSON file of second_rater_record."""
    return score_with(_load_weights(weights), response)
