"""One round's stages without training: which stages run, what each gets from the others (its
upstream), each stage's identity (from the stage's own inputs builder), the human label files a
reward model reads by content, and the summary row a round leaves."""

import hashlib

import pytest

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.context import StageOutcome
from rlflow.flows.wiring import RoundPlanner, human_labels, run_round, summary_row


def config(small_assets, root, **sections):
    return build_config(small_config_tree(small_assets, root, **sections), "t")


def sha256_of(path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


class Recorder(RoundPlanner):
    """Runs no stage: records each one's upstream and identity and returns a made-up outcome."""

    def __init__(self, config, metrics=None):
        super().__init__(config)
        self.seen, self.metrics = {}, metrics or {}

    def stage(self, stage, round_index, upstream):
        planned = self.planned(stage, round_index, upstream)
        self.seen[(round_index, stage)] = (upstream, planned)
        return StageOutcome(
            stage=stage, round_index=round_index, step=1, checkpoint_uri=f"runs/t/round_{round_index}/{stage}/step_1",
            manifest_sha256=f"{stage}-{round_index}", metrics=self.metrics.get(stage, {}),
        )


RM_METRICS = {"rm": {"rm/score_mean": 0.5, "rm/score_std": 2.0}, "label": {"label/pairs": 3.0}}


def one_round(cfg, r=0, **kwargs):
    planner = Recorder(cfg, RM_METRICS)
    start = kwargs.pop("policy", cfg.model.init_path)
    run_round(cfg, planner, r, start, kwargs.pop("sft", start), kwargs.pop("labels", []), **kwargs)
    return planner


def test_a_round_runs_its_stages_in_order_and_passes_each_its_upstream(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 2})
    planner = one_round(cfg)
    assert [stage for _, stage in planner.seen] == ["sft", "rm", "rl", "eval"]
    tiny = small_assets / "tiny-model"
    sft_up = planner.seen[(0, "sft")][0]
    assert sft_up.init.uri == str(tiny) and sft_up.init.identity.startswith("sha256:")  # model.path by content
    rl = planner.seen[(0, "rl")][0]
    assert rl.policy.identity == rl.reference.identity == rl.sft.identity == "sft-0"  # kl.reference: sft
    assert rl.reward_model.identity == "rm-0" and rl.reward_model.score_norm == (0.5, 2.0)
    assert rl.critic.identity == "rm-0"  # ppo.critic_init: rm
    evaluated = planner.seen[(0, "eval")][0]
    assert (evaluated.start.identity, evaluated.final.identity) == ("sft-0", "rl-0")
    # Round 1 (no SFT, online labels): the label stage answers with the round's policy, and the
    # reward model learns from the union of every round's labels.
    labels = [StageOutcome(stage="label", round_index=0, step=0, checkpoint_uri="runs/t/round_0/label/step_0",
                           manifest_sha256="label-0", metrics={"label/pairs": 0.0})]
    later = one_round(cfg, 1, policy=_outcome("rl", 0), sft=_outcome("sft", 0), labels=labels)
    assert [stage for _, stage in later.seen] == ["label", "rm", "rl", "eval"]
    rm_up = later.seen[(1, "rm")][0]
    assert [l.identity for l in rm_up.labels] == ["label-0", "label-1"] and rm_up.labels[0].train is None  # no pairs
    assert rm_up.labels[1].train == "runs/t/round_1/label/step_1/pairs.jsonl"


def _outcome(stage, r):
    return StageOutcome(stage=stage, round_index=r, step=1, checkpoint_uri=f"runs/t/round_{r}/{stage}/step_1",
                        manifest_sha256=f"{stage}-{r}", metrics={})


def test_critic_free_rl_and_dpo_rounds_wire_what_they_need(small_assets, tmp_path):
    grpo = one_round(config(small_assets, tmp_path, algorithm={"name": "grpo"}, rollout={"n": 2},
                            kl={"reference": "round_start"}))
    rl = grpo.seen[(0, "rl")][0]
    assert rl.critic is None and grpo.seen[(0, "rl")][1].identity_tree["ppo"] is None
    dpo = one_round(config(small_assets, tmp_path, algorithm={"name": "dpo"}, label={"online_from_round": 0}))
    assert [stage for _, stage in dpo.seen] == ["sft", "label", "dpo", "eval"]
    up = dpo.seen[(0, "dpo")][0]
    assert up.labels.identity == "label-0" and up.reference.identity == "sft-0"  # dpo.reference: round_start


def identity(small_assets, tmp_path, stage="rl", **sections):
    return one_round(config(small_assets, tmp_path, **sections)).seen[(0, stage)][1]


def test_an_identity_changes_with_what_a_stage_reads_and_never_with_a_marked_key(small_assets, tmp_path):
    base = identity(small_assets, tmp_path)
    assert base.identity == identity(small_assets, tmp_path).identity and len(base.identity) == 64
    assert base.identity_tree["format"] == 2 and base.identity_tree["stage"] == "rl"
    for changed in ({"rl": {"actor_lr": 1e-3}}, {"kl": {"coef": 0.2}}, {"sampling": {"temperature": 0.7}},
                    {"rollout": {"generate_batch": 8}}, {"run": {"seed": 5}}):
        assert identity(small_assets, tmp_path, **changed).identity != base.identity, changed
    for neutral in ({"rl": {"log_every": 4}}, {"kl": {"pause_above": 0.5, "pause_patience": 7}},
                    {"reward": {"workers": 1}}, {"rollout": {"bucket_mb": 8}}, {"eval": {"num_logged_samples": 1}}):
        assert identity(small_assets, tmp_path, **neutral).identity == base.identity, neutral
    # What the RL stage does not read: SFT's keys change SFT's identity (and so the RL stage's
    # upstream, in a real round), never the RL stage's own inputs.
    assert identity(small_assets, tmp_path, sft={"lr": 1e-3}).identity_tree == base.identity_tree
    assert identity(small_assets, tmp_path, "sft", sft={"lr": 1e-3}).identity != identity(
        small_assets, tmp_path, "sft").identity


def test_the_chat_template_enters_every_stage_that_formats_text(small_assets, tmp_path):
    plain = one_round(config(small_assets, tmp_path, run={"rounds": 2}, label={"online_from_round": 0}))
    chat = one_round(config(small_assets, tmp_path, run={"rounds": 2}, label={"online_from_round": 0},
                            data={"chat_template": "auto"}))
    for key in plain.seen:
        assert plain.seen[key][1].identity != chat.seen[key][1].identity, key
        assert plain.seen[key][1].identity_tree["data"]["chat_template"] == "none"


def test_data_files_and_functions_enter_by_content(small_assets, tmp_path):
    base = identity(small_assets, tmp_path)
    assert base.identity_tree["data"]["prompts"] == sha256_of(small_assets / "data" / "prompts.jsonl")
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes((small_assets / "data" / "prompts.jsonl").read_bytes())
    assert identity(small_assets, tmp_path, data={"prompts": str(copy)}).identity == base.identity  # another name
    copy.write_bytes(copy.read_bytes() + b'{"prompt": "one more"}\n')
    assert identity(small_assets, tmp_path, data={"prompts": str(copy)}).identity != base.identity
    assert base.identity_tree["gold"]["fn"].startswith("rlflow.engine.tasksets.demo:gold_score@sha256:")


def test_a_secret_never_enters_an_identity(small_assets, tmp_path):
    judge = {"name": "j", "type": "function", "fn": "helpers.reward_fns:zero", "weight": 0,
             "kwargs": {"api_key": "sk-123"}}
    sources = {"sources": [{"name": "rm", "type": "model"}, judge]}
    with_key = identity(small_assets, tmp_path, reward=sources, data={"storage_options": {"key": "AKIA-1"}})
    judge["kwargs"] = {"api_key": "sk-456"}
    rotated = identity(small_assets, tmp_path, reward=sources, data={"storage_options": {"key": "AKIA-2"}})
    assert with_key.identity == rotated.identity
    assert "sk-123" not in str(with_key.identity_tree) and "AKIA" not in str(with_key.identity_tree)


def test_human_label_files_are_those_of_earlier_rounds_by_content(small_assets, tmp_path):
    from rlflow.engine.stages.identity import ContentHasher

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
    found = human_labels(cfg, 2, ContentHasher())
    assert [(f.train, f.identity) for f in found] == [
        (str(folder / "round_0.jsonl"), sha256_of(folder / "round_0.jsonl")),
        (str(folder / "round_1.jsonl"), sha256_of(folder / "round_1.jsonl")),
    ]
    assert human_labels(cfg, 0, ContentHasher()) == ()
    assert len(human_labels(cfg, 11, ContentHasher())) == 4  # 0, 1, 2 and 10; never round_x or a .bak
    assert human_labels(config(small_assets, tmp_path), 2, ContentHasher()) == ()  # no label.human_inbox


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


def result(stage, metrics):
    return StageOutcome(stage=stage, round_index=0, step=3, checkpoint_uri=f"runs/t/round_0/{stage}/step_000003",
                        manifest_sha256=f"{stage}-manifest", metrics=metrics)


def test_the_summary_row_reads_the_evaluation_and_the_reward_models_accuracy():
    evaluation = result("eval", EVAL_METRICS)
    rm = result("rm", {"rm/accuracy": 0.75})
    row = summary_row(1, rm, evaluation)
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
    judged_row = summary_row(1, rm, result("eval", EVAL_METRICS | judged))
    assert {k: judged_row[k] for k in judged} == judged
    no_rm = summary_row(0, None, evaluation)
    assert no_rm["rm_accuracy"] is None and no_rm["rm_accuracy_online"] is None and no_rm["kl"] == 1.5
    with pytest.raises(KeyError, match="kl_after"):
        summary_row(0, None, result("eval", {k: v for k, v in EVAL_METRICS.items() if k != "kl_after"}))
