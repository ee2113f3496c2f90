"""A round's plan without training: each stage's identity (what enters it and what is left out on
purpose), the data fingerprints it carries, the human label files a round's reward model reads,
and the summary row and lineage tags a round leaves."""

import hashlib

import pytest

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.flows import rounds
from rlflow.flows.rounds import (
    RoundPlanner,
    _label_section,
    _summary_row,
    human_label_files,
    lineage_tags,
    model_section_of,
    rl_stage,
)
from rlflow.tasks.stages import StageResult


def config(small_assets, root, **sections):
    return build_config(small_config_tree(small_assets, root, **sections), "t")


def sha256_of(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sft_spec(cfg, parent="parent-1"):
    sections = {"sft": cfg.sft.model_dump(exclude={"rounds", "log_every"}), "model": model_section_of(cfg)}
    return RoundPlanner(cfg, parent).spec("sft", 0, sections, {"init": "model-id"}, ("sft", "sft_eval"))


def test_the_same_config_gives_the_same_identity_and_a_changed_section_key_another(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path)
    first, again = sft_spec(cfg), sft_spec(cfg, parent="another-parent")
    assert first.identity == again.identity and len(first.identity) == 64
    assert (first.stage, first.round_index, first.parent_run_id) == ("sft", 0, "parent-1")
    changed = sft_spec(config(small_assets, tmp_path, sft={"max_steps": 41}))
    assert changed.identity != first.identity
    assert changed.identity_tree["config"]["sft"]["max_steps"] == 41
    # sft.log_every is left out of the section by the caller: the identity keeps
    assert sft_spec(config(small_assets, tmp_path, sft={"log_every": 3})).identity == first.identity
    # the seed and an input's id enter every stage's identity
    assert sft_spec(config(small_assets, tmp_path, run={"seed": 5})).identity != first.identity
    planner = RoundPlanner(cfg, "p")
    other_input = planner.spec("sft", 0, {"sft": {}}, {"init": "other-model"}, ())
    assert other_input.identity != planner.spec("sft", 0, {"sft": {}}, {"init": "model-id"}, ()).identity


def test_data_fingerprints_enter_only_for_the_files_the_stage_reads(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, data={"preferences": None})
    planner = RoundPlanner(cfg, "p")
    spec = planner.spec("rm", 0, {}, {}, ("preferences", "preferences_eval"))
    data = small_assets / "data"
    assert spec.identity_tree["data"] == {
        "preferences": "none",  # data.preferences: null names no file
        "preferences_eval": sha256_of(data / "preferences_eval.jsonl"),
    }
    assert "data_options" not in spec.identity_tree  # the reward model encodes no prompts
    assert planner.fingerprints == {
        "preferences": "none",
        "preferences_eval": sha256_of(data / "preferences_eval.jsonl"),
    }
    label = planner.spec("label", 1, {}, {}, ("prompts",))
    assert label.identity_tree["data"] == {"prompts": sha256_of(data / "prompts.jsonl")}
    assert label.identity_tree["data_options"] == {"max_prompt_tokens": 32, "prompt_overflow": "truncate"}
    assert set(planner.fingerprints) == {"preferences", "preferences_eval", "prompts"}  # never eval_prompts
    longer = RoundPlanner(config(small_assets, tmp_path, data={"max_prompt_tokens": 40}), "p")
    assert longer.spec("label", 1, {}, {}, ("prompts",)).identity != label.identity


def test_a_config_secret_is_redacted_in_the_identity_tree(small_assets, tmp_path):
    planner = RoundPlanner(config(small_assets, tmp_path), "p")
    with_key = planner.spec("label", 0, {"label": {"api_key": "sk-123"}}, {}, ())
    rotated = planner.spec("label", 0, {"label": {"api_key": "sk-456"}}, {}, ())
    assert "sk-123" not in str(with_key.identity_tree) and with_key.identity == rotated.identity


class RecordingTask:
    """Stands in for the Prefect task of a stage: records the spec it is called with and commits
    a one-file final step, so the flow's "is the output still there" check finds it."""

    def __init__(self):
        self.specs, self.options = [], []

    def with_options(self, **options):
        self.options.append(options)
        return self

    def __call__(self, config, spec, *args):
        self.specs.append(spec)
        prefix = stage_prefix(config.run.root, config.run.name, spec.round_index, spec.stage)
        store = CheckpointStore(prefix)
        with store.writer(1) as w:
            w.write_bytes("out.txt", spec.identity.encode())
        final = store.mark_final(1)
        return StageResult(
            stage=spec.stage,
            round_index=spec.round_index,
            step=1,
            checkpoint_uri=store.step_url(1),
            manifest_sha256=final["manifest_sha256"],
            metrics={},
        )


def ppo_identity(small_assets, root, monkeypatch, **sections):
    cfg = config(small_assets, root, **sections)
    task = RecordingTask()
    monkeypatch.setattr(rounds, "ppo_task", task)
    sft = str(small_assets / "tiny-model")
    result = rl_stage(cfg, RoundPlanner(cfg, "p"), 0, sft, sft, sft, None)
    assert len(task.specs) == 1 and result.stage == "ppo"  # the output exists: called once, no refresh
    assert task.options[0]["retries"] == cfg.stage.policy("ppo").retries
    return task.specs[0]


def test_the_rl_stage_identity_leaves_out_the_breaker_and_logging_keys(small_assets, tmp_path, monkeypatch):
    base = ppo_identity(small_assets, tmp_path / "a", monkeypatch)
    tree = base.identity_tree
    assert tree["stage"] == "ppo" and set(tree["data"]) == {"prompts", "eval_prompts"}
    assert "pause_above" not in tree["config"]["kl"] and "log_every" not in tree["config"]["ppo"]
    assert "lora" not in tree["config"]["model"] and "path" not in tree["config"]["model"]
    kept = ppo_identity(
        small_assets,
        tmp_path / "b",
        monkeypatch,
        kl={"pause_above": 0.5, "pause_patience": 7},
        ppo={"log_every": 4},
    )
    assert kept.identity == base.identity
    for changed in ({"kl": {"coef": 0.2}}, {"ppo": {"steps": 4}}, {"sampling": {"temperature": 0.7}}):
        other = ppo_identity(small_assets, tmp_path / "c", monkeypatch, **changed)
        assert other.identity != base.identity, changed


def test_an_ensemble_and_its_penalty_enter_the_identities_and_one_head_keeps_the_old_ones(
    small_assets, tmp_path, monkeypatch
):
    def rm_identity(root, **sections):
        cfg = config(small_assets, root, **sections)
        task = RecordingTask()
        monkeypatch.setattr(rounds, "rm_task", task)
        rounds.reward_model_stage(cfg, RoundPlanner(cfg, "p"), 0, str(small_assets / "tiny-model"), [])
        return task.specs[0]

    one = rm_identity(tmp_path / "a")
    assert "ensemble" not in one.identity_tree["config"]["rm"]  # as before rm.ensemble existed
    four = rm_identity(tmp_path / "b", rm={"ensemble": 4})
    assert four.identity != one.identity and four.identity_tree["config"]["rm"]["ensemble"] == 4
    base = ppo_identity(small_assets, tmp_path / "c", monkeypatch)
    assert "uncertainty_penalty" not in base.identity_tree["config"]
    penalised = ppo_identity(
        small_assets, tmp_path / "d", monkeypatch, rm={"ensemble": 4}, reward={"uncertainty_penalty": 10.0}
    )
    assert penalised.identity != base.identity and penalised.identity_tree["config"]["uncertainty_penalty"] == 10.0
    valid = {"name": "valid", "type": "format", "weight": 0, "kwargs": {"kind": "nonempty"}}
    sources = {"sources": [{"name": "rm", "type": "model"}, valid], "valid": "valid"}
    with_rule = ppo_identity(small_assets, tmp_path / "e", monkeypatch, reward=sources)
    assert "hacking" not in with_rule.identity_tree["config"]  # off: the identity of a run without it
    assert with_rule.identity_tree["config"]["valid_rule"] == "valid"
    watched = ppo_identity(
        small_assets, tmp_path / "f", monkeypatch, reward=sources, checkpoint={"every_steps": 5},
        hacking={"enabled": True},
    )
    assert watched.identity != with_rule.identity and watched.identity_tree["config"]["hacking"]["window"] == 5


def test_model_keys_in_an_identity_skip_the_path_and_an_unset_lora(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path)
    section = model_section_of(cfg)
    assert "path" not in section and "lora" not in section and section["dtype"] == "float32"
    moved = config(small_assets, tmp_path, model={"path": str(tmp_path / "elsewhere")})
    assert model_section_of(moved) == section  # the model's own fingerprint is the stage's input
    lora = model_section_of(config(small_assets, tmp_path, model={"lora": {"r": 4}}))
    assert lora["lora"]["r"] == 4 and {k: v for k, v in lora.items() if k != "lora"} == section


def test_label_keys_skip_the_human_inbox_and_an_unset_eval_fraction(small_assets, tmp_path):
    section = _label_section(config(small_assets, tmp_path))
    assert "human_inbox" not in section and "eval_fraction" not in section
    assert section["prompts_per_round"] == 32
    inbox = _label_section(config(small_assets, tmp_path, label={"human_inbox": str(tmp_path / "inbox")}))
    assert inbox == section
    held_out = _label_section(config(small_assets, tmp_path, label={"eval_fraction": 0.25}))
    assert held_out == section | {"eval_fraction": 0.25}


def test_human_label_files_are_those_of_earlier_rounds_with_their_hashes(small_assets, tmp_path):
    inbox = tmp_path / "inbox"
    folder = inbox / "t"  # <inbox>/<run.name>/round_<n>.jsonl
    folder.mkdir(parents=True)
    for name, text in {
        "round_0.jsonl": '{"prompt": "a"}\n',
        "round_1.jsonl": '{"prompt": "b"}\n',
        "round_2.jsonl": '{"prompt": "c"}\n',
        "round_10.jsonl": '{"prompt": "d"}\n',
        "round_x.jsonl": "x\n",
        "round_1.jsonl.bak": "old\n",
        "notes.txt": "n\n",
    }.items():
        (folder / name).write_text(text)
    (inbox / "other-run").mkdir()
    (inbox / "other-run" / "round_0.jsonl").write_text("{}\n")
    cfg = config(small_assets, tmp_path, label={"human_inbox": str(inbox)})
    found = human_label_files(cfg, 2)
    assert found == {
        str(folder / "round_0.jsonl"): sha256_of(folder / "round_0.jsonl"),
        str(folder / "round_1.jsonl"): sha256_of(folder / "round_1.jsonl"),
    }
    assert human_label_files(cfg, 0) == {}
    assert len(human_label_files(cfg, 11)) == 4  # 0, 1, 2 and 10; never round_x or a .bak
    assert human_label_files(config(small_assets, tmp_path), 2) == {}  # no label.human_inbox


def result(stage, metrics, run_id=None, round_index=0):
    return StageResult(
        stage=stage,
        round_index=round_index,
        step=3,
        checkpoint_uri=f"runs/t/round_{round_index}/{stage}/step_000003",
        manifest_sha256=f"{stage}-manifest",
        metrics=metrics,
        mlflow_run_id=run_id,
    )


EVAL_METRICS = {
    "gold_score_before": 0.1,
    "gold_score_after": 0.4,
    "gold_score_stderr_after": 0.02,
    "kl_after": 1.5,
    "response_length_after": 11.0,
    "distinct_2_after": 0.8,
    "valid_fraction_after": 0.9,
    "response_length_before": 12.0,
    "distinct_2_before": 0.7,
    "valid_fraction_before": 1.0,
    "gold_gain_stderr": 0.01,
    "valid_drop_stderr": 0.03,
}


def test_the_summary_row_reads_the_evaluation_and_the_reward_models_accuracy():
    evaluation = result("eval", EVAL_METRICS)
    rm = result("rm", {"rm/accuracy": 0.75})
    row = _summary_row(1, rm, evaluation)
    assert row == {
        "round": 1,
        "rm_accuracy": 0.75,
        "rm_accuracy_online": None,  # no online held-out pairs
        "gold_score_before": 0.1,
        "gold_score_after": 0.4,
        "gold_score_stderr": 0.02,
        "kl": 1.5,
        "response_length": 11.0,
        "distinct_2": 0.8,
        "valid_fraction": 0.9,
        "response_length_before": 12.0,
        "distinct_2_before": 0.7,
        "valid_fraction_before": 1.0,
        "gold_gain_stderr": 0.01,
        "valid_drop_stderr": 0.03,
        "judge_score_before": None,  # no judge declared (reward.judge)
        "judge_score_after": None,
        "judge_gain_stderr": None,
        "judge_agreement": None,
        "regression_nll_before": None,  # no fixed regression set (data.regression)
        "regression_nll_after": None,
        "regression_nll_increase_stderr": None,
    }
    judged = {"judge_score_before": 0.5, "judge_score_after": 0.3, "judge_gain_stderr": 0.04, "judge_agreement": 0.2}
    judged_row = _summary_row(1, rm, result("eval", EVAL_METRICS | judged))
    assert {k: judged_row[k] for k in judged} == judged
    no_rm = _summary_row(0, None, evaluation)
    assert no_rm["rm_accuracy"] is None and no_rm["rm_accuracy_online"] is None and no_rm["kl"] == 1.5
    with pytest.raises(KeyError, match="kl_after"):
        _summary_row(0, None, result("eval", {k: v for k, v in EVAL_METRICS.items() if k != "kl_after"}))


def test_lineage_tags_name_the_policy_its_reward_model_and_the_data_hashed(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"name": "lin"})
    planner = RoundPlanner(cfg, "parent-9")
    planner.spec("ppo", 0, {}, {}, ("prompts",))
    policy = result("ppo", {}, run_id="ppo-run")
    tags = lineage_tags(planner, policy, result("rm", {}, run_id="rm-run"))
    assert tags == {
        "rlflow.checkpoint_uri": "runs/t/round_0/ppo/step_000003",
        "rlflow.manifest_sha256": "ppo-manifest",
        "rlflow.parent_run_id": "parent-9",
        "rlflow.ppo_run_id": "ppo-run",
        "rlflow.reward_model_run_id": "rm-run",
        "rlflow.reward_model_uri": "runs/t/round_0/rm/step_000003",
        "rlflow.algorithm": "ppo",
        "rlflow.run_name": "lin",
        "rlflow.data.prompts": sha256_of(small_assets / "data" / "prompts.jsonl"),
    }
    bare = lineage_tags(planner, result("ppo", {}), None)
    assert bare["rlflow.ppo_run_id"] == "" and bare["rlflow.reward_model_run_id"] == ""
    assert bare["rlflow.reward_model_uri"] == ""
