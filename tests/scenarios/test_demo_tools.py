"""`make demo-tools` at a reduced size: the shipped config (configs/demo_tools.yaml) with its assets
built small, through the real CLI, a real Prefect server and a real MLflow store. The demo's pieces
must fit together: SFT on whole demonstrations with `tools` (both assistant turns learned), GRPO over calculator
episodes, and an evaluation that scores the final answer and logs the episodes with their calls."""

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from helpers.pipeline import cli, finish
from rlflow.engine.tasksets.calculator import make_tools_assets

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_tools.yaml"
SIZES = {"sft": 200, "sft_eval": 16, "prompts": 32, "eval_prompts": 8}


def test_the_demo_config_runs_end_to_end_at_a_reduced_size(prefect_server, tmp_path):
    assets = make_tools_assets(tmp_path / "tools", seed=3, sizes=SIZES, model={"hidden": 32, "layers": 1})
    data = {f"data.{k}={assets / 'data' / k}.jsonl" for k in ("sft", "sft_eval", "prompts", "eval_prompts")}
    overrides = sorted(data) + [
        f"model.path={assets / 'tiny-model'}", f"run.root={tmp_path / 'runs'}", "run.name=tools-small",
        "sft.max_steps=20", "sft.eval_every=10", "sft.batch_size=16", "sft.log_every=10",
        "rl.steps=2", "rl.rollout_batch=4", "rl.mini_batch=4", "rollout.n=2",
        "eval.num_prompts=8", "eval.batch_size=8", "checkpoint.every_steps=1",
    ]
    out = finish(cli(CONFIG, *overrides))
    assert "[round 0 rl] step 2/2" in out, out[-3000:]

    summary = json.loads((tmp_path / "runs" / "tools-small" / "summary.json").read_text())["rounds"]
    assert len(summary) == 1 and 0.0 <= summary[0]["gold_score_after"] <= 1.0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs'}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id], max_results=50)
    stages = {r.data.tags.get("rlflow.stage"): r for r in runs if r.data.tags.get("rlflow.kind") == "child"}
    assert set(stages) == {"sft", "rl", "eval"}
    ppo = stages["rl"].data.metrics
    # Every episode had a first turn, and the episode metrics of the multi-turn loop are logged.
    assert ppo["env/turns"] >= 1.0 and {"env/tool_calls", "env/tool_errors", "env/truncated"} <= set(ppo)
    assert {"eval/env/turns", "eval/env/tool_calls"} <= set(stages["eval"].data.metrics)
    report = (tmp_path / "runs" / "tools-small" / "report.html").read_text()
    # The calculator's schema is in every prompt the report shows: the episodes are the env's.
    assert "calculator(expression)" in report and "what is " in report
