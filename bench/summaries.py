"""Behaviour baseline for structural changes: run a fixed set of pipelines, keep their summaries.

    python bench/summaries.py record bench/results/summaries-<label>.json   # ~20 min on 2 cores
    python bench/summaries.py compare bench/results/summaries-A.json bench/results/summaries-B.json

Record both sides on one machine: another CPU (or other torch/transformers builds) sums floats in
another order, and the same code then gives summaries that differ in their last digits. Each file keeps
the machine it was recorded on (`_machine`), and `compare` says when the two differ.

A refactor that claims "no behaviour change" must give the same `summary.json` for each of these
runs, to the digit, except for what differs by nature between two runs: seconds, run names, paths
and timestamps (dropped by `normalise`). Each run goes through its `make` target, so the same
assets are prepared as a user's `make demo` would. The set is the one issue 17 asks for.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LORA = "'model.lora={r: 16, alpha: 32, target_modules: all-linear, modules_to_save: [embed_tokens], stages: [rm, rl]}'"
DPO = "algorithm.name=dpo dpo.rpo_alpha=1 dpo.lr=3e-4 dpo.epochs=2 label.online_from_round=0 label.prompts_per_round=2048 hacking.enabled=false"
RUNS = {  # name -> (make target, overrides)
    "demo-s0": ("demo", "run.seed=0"),
    "demo-s1": ("demo", "run.seed=1"),
    "server-s0": ("demo", "rollout.mode=server"),
    "lora-s0": ("demo", LORA),
    "grpo-s0": ("demo", "algorithm.name=grpo rollout.n=4 rl.rollout_batch=16 rl.mini_batch=8"),
    "dpo-s0": ("demo", DPO),
    "deepspeed-s1": ("demo", "engine.backend=deepspeed run.seed=1"),
    "arith-s0": ("demo-arith", ""),
    "real-2steps-s0": ("demo-real", "rl.steps=2"),
}
VOLATILE_KEYS = {"run", "run_name", "name"}  # exact keys
VOLATILE = ("seconds", "path", "uri", "time", "started", "finished", "wall")  # substrings of keys


def normalise(value):
    """The summary without what differs between two identical runs (see module docstring)."""
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items() if k not in VOLATILE_KEYS and not any(s in k.lower() for s in VOLATILE)}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


def machine() -> dict:
    """What the figures depend on besides the code: the CPU, its vector units, the numeric libraries."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    libraries = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "deepspeed")}
    return {"cpu": model, "cpus": os.cpu_count(), "avx512f": "avx512f" in flags, **libraries}


def record(out: Path, only: list[str]) -> None:
    results = json.loads(out.read_text()) if out.exists() else {}
    results["_machine"] = machine()
    for name, (target, overrides) in RUNS.items():
        if only and name not in only:
            continue
        run_name = f"house-{name}"
        args = f"{overrides} run.name={run_name}".strip()
        start = time.monotonic()
        proc = subprocess.run(["make", target, f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - start
        summary = ROOT / "runs" / run_name / "summary.json"
        if proc.returncode != 0 or not summary.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise SystemExit(f"{name}: `make {target} ARGS={args}` exited {proc.returncode}\n{tail}")
        results[name] = {"command": f'make {target} ARGS="{args}"', "wall_s": round(wall, 1),
                         "summary": normalise(json.loads(summary.read_text()))}
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {wall:.0f} s", flush=True)


def compare(a: Path, b: Path) -> int:
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    if left.get("_machine") != right.get("_machine"):
        print(f"recorded on different machines ({left.get('_machine')} / {right.get('_machine')}): the last digits"
              " of the figures may differ for that alone; record both on one machine")
    bad = 0
    for name in sorted(n for n in set(left) | set(right) if not n.startswith("_")):
        if name not in left or name not in right:
            print(f"{name}: only in {a if name in left else b}")
            bad += 1
        elif left[name]["summary"] != right[name]["summary"]:
            print(f"{name}: DIFFERS\n  {json.dumps(left[name]['summary'])}\n  {json.dumps(right[name]['summary'])}")
            bad += 1
        else:
            print(f"{name}: identical")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "record":
        record(Path(argv[1]), argv[2:])
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
