"""What a continued run will do, per stage, without a model (`rlflow run --dry-run`, `rlflow status`):
the stages of each round by the flow's own wiring, each one's bound and prefix, and its state read
from its store against the identity the run would give it: done, changed (the keys that differ),
at a committed step, or not started."""

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.identity import IDENTITY_FORMAT
from rlflow.engine.stages.sft import SFTUpstream
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.flows.plan import StoreReader, format_plan, plan_run


def config(small_assets, root, **sections):
    sections["run"] = {"name": "p"} | sections.get("run", {})
    return build_config(small_config_tree(small_assets, root, **sections), "t")


def finish_sft(cfg, step=40, tree=None):
    """The round-0 SFT stage as a run of `cfg` would have finished it (its identity), or with `tree`."""
    reader = StoreReader(cfg)
    planned = reader.planned("sft", 0, SFTUpstream(init=reader.model(cfg.model.init_path)))
    store = CheckpointStore(stage_prefix(cfg.run.root, cfg.run.name, 0, "sft"))
    with store.writer(step) as w:
        w.write_bytes("x", b"x")
        w.meta.update(identity=planned.identity, identity_tree=planned.identity_tree)
    if tree is None:
        store.mark_final(step, {"identity": planned.identity, "identity_tree": planned.identity_tree})
    return store, planned


def states(cfg):
    return [(p.round_index, p.stage, p.state) for p in plan_run(cfg)]


def test_each_round_runs_its_stages_with_their_bounds_and_nothing_started(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 2}, rl={"steps": 5}, kl={"stop_above": 0.5})
    planned = plan_run(cfg)
    assert [(p.round_index, p.stage) for p in planned] == [
        (0, "sft"), (0, "rm"), (0, "rl"), (0, "eval"), (1, "label"), (1, "rm"), (1, "rl"), (1, "eval"),
    ]  # fmt: skip
    assert planned[2].steps == "5 steps x 16 prompts (ppo); stops at KL 0.5"
    assert planned[2].prefix == stage_prefix(str(tmp_path), "p", 0, "rl")
    assert planned[4].steps == "32 prompts, 2 answers each" and planned[3].steps == "32 prompts"
    assert planned[0].state == "not started" and planned[1].state == "not started (after init)"
    dpo = config(small_assets, tmp_path, run={"rounds": 1}, algorithm={"name": "dpo"})
    assert [p.stage for p in plan_run(dpo)] == ["sft", "dpo", "eval"]


def test_a_finished_stage_is_done_and_a_changed_key_is_named_where_the_run_would_stop(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 1})
    finish_sft(cfg)
    assert states(cfg)[:2] == [(0, "sft", "done at step 40"), (0, "rm", "not started")]  # rm: sft's real output
    changed = config(small_assets, tmp_path, run={"rounds": 1}, sft={"lr": 1e-3})
    lines = states(changed)
    assert lines[0][2].startswith("done at step 40, changed: sft.lr; `rlflow run` stops here")
    assert [state for _, _, state in lines[1:]] == ["not reached (round 0 sft stops the run)"] * 3
    kept = states(config(small_assets, tmp_path, run={"rounds": 1}, sft={"lr": 1e-3},
                         resume={"allow_config_change": True}))
    assert kept[0][2] == "done at step 40, changed: sft.lr; its output is kept (resume.allow_config_change)"
    assert kept[1][2] == "not started"
    # A key SFT does not read changes nothing; one marked neutral neither.
    assert states(config(small_assets, tmp_path, run={"rounds": 1}, rl={"steps": 9}))[0][2] == "done at step 40"
    assert states(config(small_assets, tmp_path, run={"rounds": 1}, sft={"log_every": 3}))[0][2] == "done at step 40"


def test_an_interrupted_stage_continues_or_is_changed(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 1})
    finish_sft(cfg, step=20, tree="interrupted")
    assert states(cfg)[0][2] == "at step 20 (committed; continues)"
    changed = states(config(small_assets, tmp_path, run={"rounds": 1}, data={"max_prompt_tokens": 30,
                                                                            "chat_template": "auto"}))
    assert changed[0][2].startswith("at step 20, changed: data.chat_template; `rlflow run` stops here")


def test_a_stage_written_by_rlflow_0_1_stops_the_plan(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 1})
    store, _ = finish_sft(cfg)
    store.mark_final(40, {"identity": "old", "identity_tree": {"stage": "sft", "config": {}}})
    lines = states(cfg)
    assert "written by rlflow 0.1" in lines[0][2] and lines[1][2].startswith("not reached")
    assert IDENTITY_FORMAT == 2


def test_the_printed_plan_lines_up_its_columns(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 1})
    finish_sft(cfg)
    planned = plan_run(cfg)
    lines = format_plan(planned).splitlines()
    assert len(lines) == 4 and lines[0].startswith("  round 0  sft  ") and lines[0].endswith("[done at step 40]")
    assert f"-> {planned[2].prefix}  [not started" in lines[2]
    assert len({line.index("->") for line in lines}) == 1  # the bounds column is padded to one width
