"""The flow's stage runner: each stage of a round (flows/wiring.py) as a Prefect task, with its
retries, a cached result whose checkpoint is gone run again, and an operator's decisions after a
breach of the RL stage; and what a registered policy came from."""

from __future__ import annotations

from rlflow.engine.config.schema import Config
from rlflow.engine.stages.context import Record
from rlflow.flows.breach import settle_breaches
from rlflow.flows.wiring import RoundPlanner
from rlflow.tasks.stages import StageResult, StageSpec, output_exists, retryable, stage_task


class TaskRunner(RoundPlanner):
    """Runs each stage of a round as its Prefect task under the run's MLflow parent run, with the
    stage's retry policy (stage.retries; each retry resumes from the last checkpoint); a cached result
    whose checkpoint is gone (deleted or pruned by hand) is not trusted: the task runs again with the
    cache refreshed. A breach of the RL stage is settled by an operator (flows/breach.py)."""

    def __init__(self, config: Config, parent_run_id: str):
        super().__init__(config)
        self.parent_run_id = parent_run_id

    def stage(self, stage: str, round_index: int, upstream: Record) -> StageResult:
        planned = self.planned(stage, round_index, upstream)
        spec = StageSpec(
            stage=stage, round_index=round_index, identity=planned.identity, identity_tree=planned.identity_tree,
            parent_run_id=self.parent_run_id,
        )
        policy = self.config.stage.policy(stage)
        task = stage_task.with_options(
            name=stage, retries=policy.retries, retry_delay_seconds=policy.retry_delay_s, retry_condition_fn=retryable
        )

        result = task(self.config, spec, upstream)
        if result.breach is not None:  # never cached: each continuation resumes from the stage's checkpoint
            return settle_breaches(self.config, result, lambda given: task(self.config, spec, upstream, given))
        if not output_exists(self.config, result):
            result = task.with_options(refresh_cache=True)(self.config, spec, upstream)
        return result


def lineage_tags(
    config: Config, planner: RoundPlanner, parent_run_id: str, policy: StageResult, rm: StageResult | None
) -> dict[str, str]:
    """What a registered policy came from: its checkpoint, runs, reward model and data."""
    tags = {
        "rlflow.checkpoint_uri": policy.checkpoint_uri,
        "rlflow.manifest_sha256": policy.manifest_sha256,
        "rlflow.parent_run_id": parent_run_id,
        "rlflow.rl_run_id": policy.mlflow_run_id or "",
        "rlflow.reward_model_run_id": (rm.mlflow_run_id or "") if rm else "",
        "rlflow.reward_model_uri": rm.checkpoint_uri if rm else "",
        "rlflow.algorithm": config.algorithm.name,
        "rlflow.run_name": config.run.name,
    }
    return tags | {f"rlflow.data.{name}": fp for name, fp in planner.data_fingerprints().items()}
