"""How long a killed stage takes to get going again, at three model sizes, measured side by side.

    python bench/resume_bench.py [--out bench/resume_results.json]

For each size an SFT stage runs as a worker process (the way a DeepSpeed rank or a restarted
job runs it), commits step 1 (optimizer shards only: the 70B case, where steps between
consolidations hold no HF model copy), and is killed at the start of step 2 by RLFLOW_FAULT. A
second process then continues. Reported per size: parameters, bytes of the step-1 checkpoint,
`checkpoint/resume_s` (stage start -> end of the first new step, models and checkpoint loading
included), how much of it was loading and restoring (the rest is the step itself), and the
restarted process's wall time (interpreter start and imports included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlflow.engine.config.schema import build_config
from rlflow.engine.tasksets.demo import make_demo_assets, make_tiny_model
from rlflow.engine.telemetry.metrics import EVENT_PREFIX
from rlflow.engine.models.loading import load_tokenizer
from rlflow.engine.config.secrets import redact
from rlflow.engine.stages.identity import IDENTITY_FORMAT
from rlflow.engine.stages.inputs import ModelInput
from rlflow.engine.stages.sft import SFTUpstream
from rlflow.engine.stages.worker import StageCall, write_spec

SIZES = {"0.4M": (128, 2), "21M": (512, 8), "130M": (1024, 12)}  # name -> (hidden, layers)


def run_worker(spec: Path, fault: str | None) -> tuple[int, float, dict[int, dict]]:
    env = dict(os.environ, RLFLOW_SECRETS="{}")
    env.pop("RLFLOW_FAULT", None)
    if fault:
        env["RLFLOW_FAULT"] = fault
    started = time.monotonic()
    command = [sys.executable, "-m", "rlflow.engine.stages.worker", str(spec)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    metrics: dict[int, dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith(EVENT_PREFIX):
            event = json.loads(line[len(EVENT_PREFIX) :])
            if event["kind"] == "metrics":
                metrics.setdefault(event["step"], {}).update(event["metrics"])
    return proc.returncode, wall, metrics


def measure(name: str, hidden: int, layers: int, assets: Path, work: Path) -> dict:
    tokenizer = load_tokenizer(str(assets / "tiny-model"))
    model = make_tiny_model(tokenizer, hidden=hidden, layers=layers)
    model_dir = work / f"model-{name}"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    names = ("sft", "sft_eval", "preferences", "preferences_eval", "prompts", "eval_prompts")
    data = {k: str(assets / "data" / f"{k}.jsonl") for k in names}
    tree = {
        "run": {"name": "bench", "root": str(work / f"runs-{name}"), "threads": 2},
        "model": {"path": str(model_dir)},
        "data": data,
        "sft": {"max_steps": 2, "batch_size": 8, "eval_every": 100, "log_every": 1, "warmup_steps": 0},
        "checkpoint": {"every_steps": 1, "keep_last": 2, "consolidate_every": 100},
    }
    init = ModelInput(uri=str(model_dir), identity="bench")
    call = StageCall(
        stage="sft",
        store_url=f"{work}/runs-{name}/sft",
        round_index=0,
        identity="bench",
        identity_tree={"format": IDENTITY_FORMAT},
        upstream=SFTUpstream(init=init).model_dump(mode="json"),
    )
    spec = work / f"spec-{name}.json"
    write_spec(str(spec), redact(build_config(tree, "bench").model_dump(mode="json")), call, str(work / "outcome.json"))
    rc, fresh_wall, _ = run_worker(spec, "sft:step:2")
    assert rc == 137, f"{name}: the kill did not happen (exit {rc})"
    step_dir = Path(call.store_url) / "step_000001"
    size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    rc, resumed_wall, resumed = run_worker(spec, None)
    assert rc == 0, f"{name}: the resumed run failed (exit {rc})"
    return {
        "size": name,
        "params": params,
        "checkpoint_bytes": size,
        "resume_s": resumed[2]["checkpoint/resume_s"],
        "step_s": resumed[2]["timing_s/elapsed"],  # the first new step's own compute
        "load_and_restore_s": resumed[2]["checkpoint/resume_s"] - resumed[2]["timing_s/elapsed"],
        "resumed_process_wall_s": resumed_wall,
        "fresh_killed_process_wall_s": fresh_wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/resume_results.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlflow-resume-bench-") as tmp:
        work = Path(tmp)
        assets = make_demo_assets(work / "assets", seed=7, sizes={"sft": 400, "sft_eval": 32})
        rows = [measure(name, h, l, assets, work) for name, (h, l) in SIZES.items()]
    for row in rows:
        print(
            f"{row['size']:>5}: {row['params'] / 1e6:7.1f}M params, "
            f"checkpoint {row['checkpoint_bytes'] / 1e9:6.2f} GB, resume_s {row['resume_s']:6.2f} "
            f"(load+restore {row['load_and_restore_s']:6.2f}, step {row['step_s']:6.2f}), "
            f"restarted process wall {row['resumed_process_wall_s']:6.2f} s"
        )
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
