"""After each round: the promotion gates decide whether the round's final policy (the candidate)
becomes the champion, the registered model's `champion` alias and the next round's start.

The decision is pure (engine/promotion/gates.py) and made again from the round's cached
evaluation whenever a run is continued, so a process killed between the decision and the alias
move records the same outcome when it is started again: no double promotion, no lost rejection.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
from prefect.artifacts import create_markdown_artifact
from prefect.input import RunInput

from rlflow.engine.config.schema import Config
from rlflow.engine.errors import RunHalted
from rlflow.engine.faults import fault_point
from rlflow.engine.promotion.gates import PromotionDecision, decide_promotion, gate_table
from rlflow.engine.storage.files import now_iso
from rlflow.flows.breach import pause_until_answered, post_alert, temporary_server
from rlflow.flows.plan import OVERRIDES_FILE, read_overrides, read_run_file
from rlflow.tasks.tracking import RunTracker, point_champion_alias, record_promotion


@dataclass(frozen=True)
class Promotion:
    """A round's outcome: its decision, and the champion's registered version after it."""

    decision: PromotionDecision
    champion_version: str | None


def write_override(cfg: Config, round_index: int, by: str, reason: str) -> str:
    """Record a manual promotion of round `round_index`, which every later decision of the round
    (a continued run) honours; returns its "<who>: <why>"."""
    text = read_run_file(cfg.run.root, cfg.run.name, OVERRIDES_FILE, cfg.run.storage_options)
    data = json.loads(text) if text else {"rounds": {}}
    data["rounds"][str(round_index)] = {"by": by, "reason": reason, "at": now_iso()}
    url = f"{cfg.run.root.rstrip('/')}/{cfg.run.name}/{OVERRIDES_FILE}"
    with fsspec.open(url, "w", **cfg.run.storage_options) as f:
        f.write(json.dumps(data, indent=2))
    return f"{by}: {reason}"


def artifact_key(run_name: str, round_index: int) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes only) for the round's gate table."""
    return f"promotion-{re.sub(r'[^a-z0-9]+', '-', run_name.lower()).strip('-')}-round-{round_index}"


def settle_promotion(
    cfg: Config,
    tracker: RunTracker,
    parent_run_id: str,
    round_index: int,
    row: dict[str, Any],
    version: str,
    champion: str | None,
    logger: Any,
) -> Promotion:
    """Decide round `round_index` (registered as `version`; `champion` the version promoted before
    it, None if none), record it in the registry, the flow run's artifacts and the parent MLflow run,
    and alert on a rejection."""
    decision = decide_promotion(row, cfg.promotion.gates, read_overrides(cfg).get(round_index))
    failed = {g.metric: g.reason for g in decision.failed}
    champion = version if decision.promoted else champion
    record_promotion(tracker.client, cfg.run.name, version, failed, decision.override)
    # The alias last: a process killed here leaves the tags, and the continued run, deciding the
    # same again, moves it (tests/scenarios/test_promotion.py kills it at this point).
    fault_point("promotion", "alias", round_index)
    point_champion_alias(tracker.client, cfg.run.name, champion)
    table = gate_table(decision, round_index)
    create_markdown_artifact(
        table, key=artifact_key(cfg.run.name, round_index), description=f"round {round_index} promotion gates"
    )
    tracker.sink(parent_run_id).log_text(f"promotion/round_{round_index}.md", table)
    if decision.promoted:
        by_hand = f" by hand ({decision.override})" if decision.override else ""
        logger.info("round %d promoted%s: version %s is the champion", round_index, by_hand, version)
        return Promotion(decision, champion)
    reasons = "; ".join(f"{g}: {why}" for g, why in failed.items())
    logger.warning(
        "round %d rejected (%s): the next round starts from this round's start; champion: %s",
        round_index,
        reasons,
        f"version {champion}" if champion else "none yet",
    )
    payload = {"run": cfg.run.name, "round": round_index, "event": "promotion_rejected", "version": version}
    post_alert(cfg, payload | {"champion_version": champion, "failed_gates": failed}, f"round {round_index} rejected")
    return Promotion(decision, champion)


class RejectionAnswer(RunInput):
    """The operator's answer to a rejected round (promotion.on_reject=pause; the Prefect UI's form)."""

    action: Literal["continue", "promote", "stop"] = "continue"
    operator: str = ""  # action=promote: who promotes it (recorded with the reason)
    reason: str = ""  # action=promote: why

    def problem(self) -> str | None:
        """Why this answer cannot be carried out (None: it can)."""
        if self.action == "promote" and not (self.operator.strip() and self.reason.strip()):
            return "action promote needs an operator and a reason (both are recorded on the registered version)"
        return None


def ask_on_rejection(cfg: Config, round_index: int, rejected: str) -> RejectionAnswer:
    """Pause the flow run until an operator answers; an answer that cannot be carried out is
    refused with an error and asked again."""
    description = (
        f"**{rejected}.**\n\naction `continue` (the next round starts from the champion), `promote` (with"
        " `operator` and `reason`: the round becomes the champion and the next round's start), or `stop`."
    )
    timeout = cfg.safety.pause_timeout_s
    timed_out = f"{rejected}; nobody answered within safety.pause_timeout_s={timeout:g}."
    timed_out += f" {_how_to_go_on(cfg, round_index)}"
    return pause_until_answered(
        lambda: RejectionAnswer.with_initial_data(description=description),
        RejectionAnswer.problem,
        timeout,
        timed_out,
        f"round {round_index}",
    )


def _how_to_go_on(cfg: Config, round_index: int) -> str:
    return (
        "Continue it with promotion.on_reject=continue (the next round starts from the champion) or other"
        f" promotion.gates, or promote it by hand with `rlflow promote {cfg.run.name} --round {round_index}"
        " --reason ...` and continue"
    )


def answer_rejection(
    cfg: Config,
    round_index: int,
    version: str,
    outcome: Promotion,
    settle: Callable[[], Promotion],
    ask: Callable[[Config, int, str], RejectionAnswer] = ask_on_rejection,
) -> Promotion:
    """What the flow does after a rejected round, once it is recorded (promotion.on_reject):
    continue; fail (RunHalted, exit 3); or pause for an operator, who continues, stops or promotes
    it (recorded as a manual override; `settle` decides the round again). A temporary Prefect
    server cannot be resumed from, so a pause there fails at once, saying how to go on."""
    if outcome.decision.promoted or cfg.promotion.on_reject == "continue":
        return outcome
    reasons = "; ".join(f"{g.metric}: {g.reason}" for g in outcome.decision.failed)
    rejected = f"round {round_index}'s policy (version {version}) was rejected by the promotion gates ({reasons})"
    how = _how_to_go_on(cfg, round_index)
    if cfg.promotion.on_reject == "fail":
        raise RunHalted(f"{rejected}; promotion.on_reject=fail stops the run here. {how}")
    if temporary_server():
        raise RunHalted(
            f"{rejected}; this run's Prefect server is temporary (PREFECT_API_URL is unset), so"
            f" promotion.on_reject=pause cannot pause for an answer. {how}"
        )
    answer = ask(cfg, round_index, rejected)
    if answer.action == "stop":
        raise RunHalted(f"{rejected}; stopped by the operator. {how}")
    if answer.action == "continue":
        return outcome
    write_override(cfg, round_index, answer.operator.strip(), answer.reason.strip())
    return settle()
