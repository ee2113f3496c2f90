"""Guards around every stage's step loop: SIGTERM preemption, the hang watchdog, skipped
non-finite updates. Faults are injected with RLFLOW_FAULT, never with sleeps or timers."""

import logging
import math
import os
import subprocess
import sys
import time

import pytest

from conftest import RecordingSink, small_config_tree
from helpers.stage_ctx import make_ctx, run_call, sft_call
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import NonFiniteUpdates, StageHung, StagePreempted
from rlflow.engine.config.secrets import redact
from rlflow.engine.stages.worker import write_spec


def sft_setup(assets, root, **sections):
    tree = small_config_tree(
        assets,
        root,
        sft={"max_steps": 6, "eval_every": 3, "batch_size": 16, "warmup_steps": 1, "log_every": 1},
        **sections,
    )
    call = sft_call(root, assets / "tiny-model")
    return build_config(tree, "test"), call


def test_sigterm_checkpoints_at_the_next_step_boundary_and_exits_cleanly(small_assets, tmp_path):
    config, call = sft_setup(small_assets, tmp_path, checkpoint={"every_steps": 100})
    spec = tmp_path / "spec.json"
    write_spec(str(spec), redact(config.model_dump(mode="json")), call, str(tmp_path / "outcome.json"))
    env = dict(os.environ, RLFLOW_SECRETS="{}", RLFLOW_FAULT="sft:sigterm:3")  # SIGTERM to itself at step 3
    proc = subprocess.run(
        [sys.executable, "-m", "rlflow.engine.stages.worker", str(spec)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == StagePreempted.exit_code, proc.stderr[-2000:]
    assert "stopped by SIGTERM after committing step 3" in proc.stderr and "Traceback" not in proc.stderr
    store = CheckpointStore(call.store_url)
    assert store.committed_steps() == [3] and store.final() is None  # no scheduled checkpoint before 100
    store.verify(3)

    outcome = run_call(config, call, sink=RecordingSink())
    assert outcome.resumed_from == 3 and outcome.step == 6


def test_a_hang_dumps_every_stack_fails_the_stage_and_a_rerun_resumes(small_assets, tmp_path, monkeypatch, caplog):
    # 5 s: a tiny SFT step takes ~0.1 s, but on a loaded machine 1 s was seen to pass mid-backward.
    config, call = sft_setup(small_assets, tmp_path, stage={"hang_timeout_s": 5.0}, checkpoint={"every_steps": 2})
    monkeypatch.setenv("RLFLOW_FAULT", "sft:hang:3")
    with caplog.at_level(logging.ERROR), pytest.raises(StageHung, match=r"no step finished for 5 s"):
        run_call(config, call, sink=RecordingSink())
    dump = "\n".join(r.getMessage() for r in caplog.records)
    assert "thread stacks" in dump and "faults.py" in dump and "rlflow-watchdog-sft" in dump  # the hung frame

    monkeypatch.delenv("RLFLOW_FAULT")
    sink = RecordingSink()
    outcome = run_call(config, call, sink=sink)
    assert outcome.resumed_from == 2 and outcome.step == 6
    assert [s for s, _ in sink.series("sft/loss")] == [3, 4, 5, 6]
    assert sink.series("checkpoint/resume_s")[0][0] == 3


def test_a_non_finite_update_is_skipped_and_counted(small_assets, tmp_path, monkeypatch):
    config, call = sft_setup(small_assets, tmp_path, checkpoint={"every_steps": 1, "keep_last": 10})
    monkeypatch.setenv("RLFLOW_FAULT", "sft:nonfinite:3")
    sink = RecordingSink()
    outcome = run_call(config, call, sink=sink)
    assert outcome.step == 6
    losses = dict(sink.series("sft/loss"))
    assert math.isnan(losses[3]) and all(math.isfinite(losses[s]) for s in (1, 2, 4, 5, 6))
    assert dict(sink.series("train/nonfinite_skips")) == {1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0}
    store = CheckpointStore(call.store_url)
    adam = [store.read_json(s, "training_state.json")["engines"]["model"]["adam_step"] for s in (2, 3, 4)]
    assert adam == [2, 2, 3]  # step 3 left the optimizer (and so the weights) untouched


def test_too_many_non_finite_updates_in_a_row_stop_the_stage_with_the_last_checkpoint_intact(
    small_assets, tmp_path, monkeypatch
):
    config, call = sft_setup(small_assets, tmp_path, safety={"max_nonfinite_skips": 0}, checkpoint={"every_steps": 2})
    monkeypatch.setenv("RLFLOW_FAULT", "sft:nonfinite:3")
    with pytest.raises(NonFiniteUpdates, match=r"safety.max_nonfinite_skips=0\) at step 3.*checkpoint is intact"):
        run_call(config, call, sink=RecordingSink())
    store = CheckpointStore(call.store_url)
    assert store.committed_steps() == [2] and store.final() is None
    store.verify(2)


def test_the_watchdog_fires_between_steps_but_never_during_a_checkpoint_write(tmp_path):
    from rlflow.engine.stages.guard import StageGuard
    from rlflow.engine.stages.context import GuardLimits

    ctx = make_ctx(tmp_path, "sft", limits=GuardLimits(hang_timeout_s=0.2))
    with StageGuard(ctx, None) as guard:
        guard.begin(1)
        guard.end(1)
        assert guard.checkpoint_due(2, last=True)
        time.sleep(0.8)  # a slow checkpoint write: four times the limit
        guard.after_checkpoint(2, "url")
    with pytest.raises(StageHung, match="no step finished for 0.2 s"), StageGuard(ctx, None) as guard:
        guard.begin(1)
        for _ in range(600):  # a step that never ends (up to 30 s: the watchdog's thread may start late)
            time.sleep(0.05)
        pytest.fail("the watchdog did not fire")


def test_a_sigterm_after_the_last_checkpoint_stops_the_stage_before_it_is_marked_finished(tmp_path):
    import signal

    from rlflow.engine.stages.context import StageContext
    from rlflow.engine.stages.guard import StageGuard

    ctx = StageContext(CheckpointStore(f"{tmp_path}/sft"), "sft", 0, 0, "x", {})
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StagePreempted, match="after its last step was committed"), StageGuard(ctx, None) as guard:
        guard.begin(1)
        assert guard.checkpoint_due(1, last=True)
        guard.after_checkpoint(1, "url")
        os.kill(os.getpid(), signal.SIGTERM)  # between the loop's end and final.json
    assert signal.getsignal(signal.SIGTERM) is before  # the guard's handler is gone again
