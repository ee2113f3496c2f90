"""The `promotion` section: the gates a round's final policy (the candidate) must pass to become the
champion, the policy the next round starts from and the registered model's `champion` alias."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlflow.engine.config.base import Section, one_of
from rlflow.engine.promotion.gates import GATE_METRICS


class PromotionGate(Section):
    metric: Annotated[str, one_of(tuple(GATE_METRICS), "promotion gate metric")]
    """What the gate reads from the round's evaluation (engine/promotion/gates.py GATE_METRICS)."""
    min: float | None = None
    """The candidate passes only with metric >= min."""
    max: float | None = None
    """The candidate passes only with metric <= max."""
    optional: bool = False
    """A gate whose metric the round did not measure is skipped; otherwise it fails (closed)."""

    @model_validator(mode="after")
    def _a_bound(self) -> PromotionGate:
        bounds = [b for b in (self.min, self.max) if b is not None]
        if not bounds:
            raise ValueError(f"promotion gate {self.metric!r} needs min or max (or both)")
        if not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"promotion gate {self.metric!r}: min and max must be finite numbers")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"promotion gate {self.metric!r}: min {self.min} is above max {self.max}")
        return self


def _default_gates() -> list[PromotionGate]:
    # Checks that need no gold: the policy must not lose its format, collapse in diversity or drift in
    # length. Thresholds from the demo's rounds (docs/promotion.md): a valid share that falls 0.15 from
    # a fully valid start ends at 0.85; distinct-2 at 0.8 of the start rejected rounds that raised the
    # gold by 0.18-0.27 at a valid share of 0.87-0.98, 0.6 still rejects a KL-free collapse (0.49).
    # Distinct-2 is optional: answers of one word (demo-arith's sums) have no word pairs.
    return [
        PromotionGate(metric="valid_drop", max=0.15),
        PromotionGate(metric="distinct_2_ratio", min=0.6, optional=True),
        PromotionGate(metric="length_ratio", min=0.5, max=2.0),
    ]


class PromotionConfig(Section):
    enabled: bool = True
    """Check each round's candidate against the gates; a rejected one is not the next round's start
    (false: every round's policy is the next round's start, as before promotion existed)."""
    gates: list[PromotionGate] = Field(default_factory=_default_gates)
    """Every gate must pass for a promotion (each {metric, min and/or max, optional})."""
    on_reject: Literal["continue", "pause", "fail"] = "continue"
    """After a rejected round: continue (the next round starts from the champion), pause the flow run
    for an operator (continue, promote or stop; a temporary Prefect server fails instead) or fail (exit 3)."""
