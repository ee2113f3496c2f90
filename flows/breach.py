"""What the flow does when PPO returns a breach (KL circuit breaker, reward failure): alert, then
pause the flow run for an operator's decision (continue, roll back, stop) and act on it.

Only flow code can pause in Prefect 3, so the task returns the breach as a result and the flow
handles it here. A paused run needs a persistent Prefect server to be resumed from (the UI's
form, or ``resume_flow_run(flow_run_id, run_input=...)``); with the temporary server `rlflow run`
starts when PREFECT_API_URL is unset nobody could resume it, so the run fails at once with the
command that continues it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Literal

import pydantic
from prefect import get_run_logger
from prefect.exceptions import FlowPauseTimeout, MissingContextError
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.settings import get_current_settings
from pydantic import Field

from rlflow.engine.stages.breaker import BREACH_KL, roll_back

from rlflow.engine.stages.context import Breach, StageOverrides
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.config.schema import Config
from rlflow.engine.errors import CheckpointError, RunHalted
from rlflow.engine.config.secrets import REDACTED, redact_override
from rlflow.tasks.stages import StageResult

COMMAND_ENV = "RLFLOW_COMMAND"  # JSON {"config": path, "overrides": [...]} of the CLI call, secrets redacted
PAUSE_POLL_S = 2  # how often a paused flow asks the server whether it was resumed (one cheap read)

log = logging.getLogger(__name__)


class BreachDecision(RunInput):
    """The operator's answer to a paused stage (the Prefect UI's form on resume)."""

    action: Literal["continue", "rollback", "stop"] = "continue"
    max_kl: float | None = Field(None, gt=0)  # new kl.pause_above for the rest of the stage; empty keeps it
    kl_coef: float | None = Field(None, ge=0)  # new KL coefficient (the controller's value); empty keeps it
    rollback_step: int | None = Field(None, ge=0)  # action=rollback: a committed step to continue from

    def problem(self, committed: list[int]) -> str | None:
        """Why this decision cannot be carried out (None: it can)."""
        if self.kl_coef is not None and not math.isfinite(self.kl_coef):
            return f"kl_coef={self.kl_coef} is not a finite number"
        if self.action == "rollback" and self.rollback_step not in committed:
            return f"rollback_step={self.rollback_step} is not a committed step (committed: {committed})"
        return None


def shown_command(config_path: str, overrides: list[str] | tuple[str, ...]) -> str:
    """The CLI call as $RLFLOW_COMMAND holds it: secret override values (credentials) redacted."""
    return json.dumps({"config": config_path, "overrides": [redact_override(text) for text in overrides]})


def continue_command(config: Config, breach: Breach) -> str:
    """The exact `rlflow run` call that continues this run after `breach` (the stage resumes from
    its checkpoint: the breaker keys are not part of its identity, so no resume.allow_config_change)."""
    call = json.loads(os.environ.get(COMMAND_ENV) or '{"config": "CONFIG", "overrides": []}')
    extra = {"run.name": config.run.name}
    if breach.reason == BREACH_KL:  # a suggestion (the operator picks the limit): room above the KL seen
        limit, kl = breach.metrics["safety/max_kl"], breach.metrics.get("actor/kl", 0.0)
        extra["kl.pause_above"] = f"{max(2 * limit, 2 * kl if math.isfinite(kl) else 0.0):.2g}"
    kept = [o for o in call["overrides"] if o.split("=", 1)[0].strip() not in extra]
    secret = [o.split("=", 1)[0] for o in kept if o.endswith(f"={REDACTED}")]  # their values were never kept
    kept = [o for o in kept if not o.endswith(f"={REDACTED}")]
    command = "rlflow run " + shlex.join([call["config"], *kept, *(f"{k}={v}" for k, v in extra.items())])
    return command + (f" (and your values of {', '.join(secret)} again)" if secret else "")


def temporary_server() -> bool:
    """Whether this flow reports to a temporary Prefect server (no API URL in the settings: the
    client started one for this process), which nothing can resume a paused run on."""
    return get_current_settings().api.url is None


def flow_logger() -> Any:
    try:
        return get_run_logger()
    except MissingContextError:  # called outside a flow run (tests, scripts)
        return log


def _stores(config: Config, result: StageResult) -> tuple[CheckpointStore, CheckpointStore | None]:
    """The stage's checkpoint store and its mirror (checkpoint.mirror), if any."""
    run, r, stage = config.run, result.round_index, result.stage
    store = CheckpointStore(stage_prefix(run.root, run.name, r, stage), run.storage_options)
    ck = config.checkpoint
    if not ck.mirror:
        return store, None
    return store, CheckpointStore(stage_prefix(ck.mirror, run.name, r, stage), ck.mirror_storage_options)


def send_alert(config: Config, result: StageResult) -> bool:
    """POST the breach to alerts.webhook_url as JSON; returns whether it went."""
    breach = result.breach
    if breach is None:
        return False
    payload = {
        "run": config.run.name,
        "round": result.round_index,
        "stage": result.stage,
        "step": breach.step,
        "reason": breach.reason,
        "metrics": {k: (v if math.isfinite(v) else None) for k, v in breach.metrics.items()},
    }
    return post_alert(config, payload, f"{breach.reason} at step {breach.step}")


def post_alert(config: Config, payload: dict[str, Any], what: str) -> bool:
    """POST `payload` to alerts.webhook_url as JSON (a breach, a rejected round); a failure only
    warns. Neither the URL nor the headers (both may hold tokens) appear in the payload or the log.
    Returns whether it went."""
    alerts = config.alerts
    if not alerts.webhook_url:
        return False
    request = urllib.request.Request(
        alerts.webhook_url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **alerts.headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=alerts.timeout_s) as response:
            response.read()
    except Exception as exc:  # an alert must never stop the run
        # Only the error's type and HTTP status: messages may quote parts of the URL (a token).
        status = f" (HTTP {exc.code})" if isinstance(exc, urllib.error.HTTPError) else ""
        name = type(exc).__name__
        flow_logger().warning("alert webhook (alerts.webhook_url) failed: %s%s; the run goes on", name, status)
        return False
    flow_logger().info("alert sent to alerts.webhook_url: %s", what)
    return True


def pause_until_answered(
    form: Callable[[], type[RunInput]],
    problem: Callable[[Any], str | None],
    timeout_s: float,
    timed_out: str,
    where: str,
) -> Any:
    """Pause the flow run for an operator's answer to `form()` (built anew for each pause); an
    invalid answer, or one `problem` refuses (a reason, None: it can be carried out), is logged and
    asked again. Nobody answering within `timeout_s` raises RunHalted(`timed_out`)."""
    logger = flow_logger()
    while True:
        try:
            answer = pause_flow_run(wait_for_input=form(), timeout=int(timeout_s), poll_interval=PAUSE_POLL_S)
        except FlowPauseTimeout:
            raise RunHalted(timed_out) from None
        except pydantic.ValidationError as exc:
            logger.error("%s: the answer is not valid (%s); pausing again", where, " ".join(str(exc).split()))
            continue
        refused = problem(answer)
        if refused is None:
            return answer
        logger.error("%s: %s; pausing again", where, refused)


def ask_operator(config: Config, result: StageResult) -> BreachDecision:
    """Pause the flow run until an operator answers; a decision that cannot be carried out (a
    rollback to a step that is not committed) is refused with an error and asked again."""
    breach = result.breach
    assert breach is not None
    store, _ = _stores(config, result)
    where = f"round {result.round_index} {result.stage}"
    committed: list[int] = []  # read again at each pause: what the form offers and the answer is checked against

    def form() -> BreachDecision:
        committed[:] = store.committed_steps()
        return BreachDecision.with_initial_data(
            description=(
                f"**{where}: {breach.message}.**\n\naction `continue` (optionally with a new `max_kl` and/or"
                f" `kl_coef`), `rollback` to `rollback_step` (committed steps: {committed}) and continue from"
                " there, or `stop`."
            )
        )

    timeout = config.safety.pause_timeout_s
    timed_out = (
        f"{where}: {breach.message}; nobody answered within safety.pause_timeout_s={timeout:g};"
        f" continue with: {continue_command(config, breach)}"
    )
    return pause_until_answered(form, lambda decision: decision.problem(committed), timeout, timed_out, where)


def settle_breaches(
    config: Config,
    result: StageResult,
    rerun: Callable[[StageOverrides], StageResult],
    ask: Callable[[Config, StageResult], BreachDecision] = ask_operator,
) -> StageResult:
    """Until the stage finishes: alert, ask, then continue (`rerun` with the operator's overrides;
    the stage resumes from its checkpoint), roll back (delete the later steps, then continue) or
    stop (RunHalted). Without a persistent Prefect server: RunHalted with the continue command."""
    logger = flow_logger()
    while (breach := result.breach) is not None:
        where = f"round {result.round_index} {result.stage}"
        logger.warning("%s: %s", where, breach.message)
        send_alert(config, result)
        if temporary_server():
            raise RunHalted(
                f"{where}: {breach.message}; this run's Prefect server is temporary (PREFECT_API_URL is unset), so"
                f" it cannot pause for an answer; continue with: {continue_command(config, breach)}"
            )
        decision = ask(config, result)
        if decision.action == "stop":
            raise RunHalted(
                f"{where}: stopped by the operator after: {breach.message}; continue with:"
                f" {continue_command(config, breach)}"
            )
        from_step = breach.step
        if decision.action == "rollback":
            assert decision.rollback_step is not None
            store, mirror = _stores(config, result)
            try:
                deleted = roll_back(store, decision.rollback_step, mirror)
            except CheckpointError as exc:  # checked when answered; raced by a hand deletion since
                raise RunHalted(f"{where}: {exc}") from None
            from_step = decision.rollback_step
            logger.warning("%s: rolled back to step %d (deleted steps %s)", where, from_step, deleted)
        overrides = StageOverrides(decision.max_kl, decision.kl_coef, from_step)
        logger.warning("%s: continuing from step %d with %s", where, from_step, overrides)
        result = rerun(overrides)
    return result
