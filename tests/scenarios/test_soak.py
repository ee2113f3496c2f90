"""Soak (`make test-slow`, not CI): 300 PPO steps on the tiny model, a checkpoint every step,
keep_last=3, the mirror on. Disk use stays bounded; after warm-up, resident memory grows by less
than 10% and no file handle or thread leaks. Prints the figures it measured."""

import json
import os
import threading
from pathlib import Path

import psutil
import pytest

from conftest import small_config_tree
from helpers.stage_ctx import rl_call, run_call
from rlflow.engine.config.schema import build_config

STEPS, WARMUP = 300, 50


class ResourceSink:
    """Samples the process's resources at every logged step."""

    def __init__(self, stage_dir: Path):
        self.stage_dir, self.samples, self.process = stage_dir, {}, psutil.Process()

    def log_metrics(self, metrics, step):
        if "actor/kl" not in metrics:
            return
        disk = sum(f.stat().st_size for f in self.stage_dir.rglob("*") if f.is_file())
        self.samples[step] = {
            "rss_mb": self.process.memory_info().rss / 2**20,
            "fds": self.process.num_fds(),
            "threads": threading.active_count(),
            "disk_mb": disk / 2**20,
            "mirror_lag": metrics.get("checkpoint/mirror_lag_steps", 0.0),
        }

    def log_table(self, name, rows):
        pass

    def log_text(self, name, text):
        pass


@pytest.mark.slow
def test_soak_300_rl_steps_with_a_checkpoint_every_step(trained, small_assets, tmp_path):
    sft_dir, rm_dir, score_norm = trained
    tree = small_config_tree(
        small_assets,
        tmp_path / "runs",
        rl={"steps": STEPS, "log_every": 1},
        eval={"every_steps": 100},
        checkpoint={"every_steps": 1, "keep_last": 3, "consolidate_every": 10, "mirror": str(tmp_path / "mirror")},
    )
    config = build_config(tree, "soak")
    call = rl_call(f"{tmp_path}/runs/t/round_0", sft_dir, rm_dir, score_norm, critic=rm_dir, identity="soak")
    sink = ResourceSink(Path(call.store_url))
    outcome = run_call(config, call, sink=sink)
    assert outcome.step == STEPS

    s = sink.samples
    warm, end = s[WARMUP], s[STEPS]
    peak_disk_after_warmup = max(v["disk_mb"] for k, v in s.items() if k >= WARMUP)
    report = {
        "rss_mb": [round(s[k]["rss_mb"], 1) for k in (1, WARMUP, 150, STEPS)],
        "disk_mb": [round(s[k]["disk_mb"], 2) for k in (1, WARMUP, 150, STEPS)],
        "peak_disk_mb_after_warmup": round(peak_disk_after_warmup, 2),
        "fds": [s[k]["fds"] for k in (1, WARMUP, STEPS)],
        "threads": [s[k]["threads"] for k in (1, WARMUP, STEPS)],
        "max_mirror_lag": max(v["mirror_lag"] for v in s.values()),
    }
    print("\nsoak:", json.dumps(report))
    assert end["rss_mb"] < 1.10 * warm["rss_mb"], report
    assert peak_disk_after_warmup < 1.5 * max(v["disk_mb"] for k, v in s.items() if k <= WARMUP), report
    assert end["fds"] <= warm["fds"] and end["threads"] <= warm["threads"], report
    mirror_steps = sorted(p.name for p in (tmp_path / "mirror").rglob("step_*"))
    assert len(mirror_steps) <= 3 + 2 and os.path.isfile(tmp_path / "mirror" / "t" / "round_0" / "rl" / "final.json")
