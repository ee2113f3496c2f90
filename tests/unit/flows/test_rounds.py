"""The flow's stage runner without Prefect or training: each stage goes to its task with its
identity and retry policy, a cached result whose output is gone runs again, and a registered
policy's lineage tags name what it came from."""

import hashlib

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.flows import rounds
from rlflow.flows.rounds import TaskRunner, lineage_tags
from rlflow.flows.wiring import run_round
from rlflow.tasks.stages import StageResult


def config(small_assets, root, **sections):
    return build_config(small_config_tree(small_assets, root, **sections), "t")


class RecordingTask:
    """Stands in for the Prefect task: records each call and its options, and commits a one-file
    final step (the flow's "is the output still there" check finds it); for a stage in `lose`, the
    first call returns a result that is no longer the store's (a cache record of a deleted run)."""

    def __init__(self, lose=()):
        self.calls, self.options, self.lose = [], [], set(lose)

    def with_options(self, **options):
        self.options.append(options)
        return self

    def __call__(self, config, spec, upstream, overrides=None):
        self.calls.append((spec, upstream))
        store = CheckpointStore(stage_prefix(config.run.root, config.run.name, spec.round_index, spec.stage))
        with store.writer(1) as w:
            w.write_bytes("out.txt", spec.identity.encode())
        manifest = store.mark_final(1)["manifest_sha256"]
        if spec.stage in self.lose:  # a cached result whose output is not the store's now: the first call only
            self.lose.discard(spec.stage)
            manifest = "replaced-since"
        metrics = {"rm/score_mean": 0.0, "rm/score_std": 1.0} if spec.stage == "rm" else {}
        return StageResult(stage=spec.stage, round_index=spec.round_index, step=1, checkpoint_uri=store.step_url(1),
                           manifest_sha256=manifest, metrics=metrics, mlflow_run_id=f"{spec.stage}-run")


def test_each_stage_goes_to_its_task_with_its_identity_and_retry_policy(small_assets, tmp_path, monkeypatch):
    cfg = config(small_assets, tmp_path, stage={"retries": 1, "rl": {"retries": 4, "retry_delay_s": 2.5}})
    task = RecordingTask(lose=("rm",))
    monkeypatch.setattr(rounds, "stage_task", task)
    runner = TaskRunner(cfg, "parent-7")
    start = cfg.model.init_path
    outputs = run_round(cfg, runner, 0, start, start, [])
    stages = [spec.stage for spec, _ in task.calls]
    assert stages == ["sft", "rm", "rm", "rl", "eval"]  # the rm output was gone: its task ran again
    names = [o.get("name") for o in task.options if "name" in o]
    assert names == ["sft", "rm", "rl", "eval"]
    rl_options = next(o for o in task.options if o.get("name") == "rl")
    assert (rl_options["retries"], rl_options["retry_delay_seconds"]) == (4, 2.5)
    assert {o.get("refresh_cache") for o in task.options} == {None, True}
    for spec, upstream in task.calls:
        planned = runner.planned(spec.stage, 0, upstream)
        assert (spec.identity, spec.identity_tree, spec.parent_run_id) == (
            planned.identity, planned.identity_tree, "parent-7")
    assert outputs.final.stage == "rl" and outputs.evaluation.stage == "eval"


def test_lineage_tags_name_the_policy_its_reward_model_and_the_data_by_content(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"name": "lin"}, data={"regression": None})
    planner = TaskRunner(cfg, "parent-9")

    def result(stage, run_id=None):
        return StageResult(stage=stage, round_index=0, step=3, checkpoint_uri=f"runs/lin/round_0/{stage}/step_000003",
                           manifest_sha256=f"{stage}-manifest", metrics={}, mlflow_run_id=run_id)

    tags = lineage_tags(cfg, planner, "parent-9", result("rl", "rl-run"), result("rm", "rm-run"))
    data = small_assets / "data"
    hashed = {n: hashlib.sha256((data / f"{n}.jsonl").read_bytes()).hexdigest()
              for n in ("sft", "sft_eval", "preferences", "preferences_eval", "prompts", "eval_prompts")}
    assert tags == {
        "rlflow.checkpoint_uri": "runs/lin/round_0/rl/step_000003",
        "rlflow.manifest_sha256": "rl-manifest",
        "rlflow.parent_run_id": "parent-9",
        "rlflow.rl_run_id": "rl-run",
        "rlflow.reward_model_run_id": "rm-run",
        "rlflow.reward_model_uri": "runs/lin/round_0/rm/step_000003",
        "rlflow.algorithm": "ppo",
        "rlflow.run_name": "lin",
    } | {f"rlflow.data.{n}": h for n, h in hashed.items()}
    bare = lineage_tags(cfg, planner, "parent-9", result("rl"), None)
    assert bare["rlflow.rl_run_id"] == "" and bare["rlflow.reward_model_run_id"] == ""
    assert bare["rlflow.reward_model_uri"] == ""
