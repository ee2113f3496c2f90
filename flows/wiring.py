"""One round's stages and what each passes on to the next, declared once: the flow runs them
(flows/rounds.py hands each to a Prefect task) and `rlflow run --dry-run` / `rlflow status` read how
far each got (flows/plan.py), both through `run_rounds` with a runner of their own.

A stage's identity is the hash of its inputs record (engine/stages/identity.py), which its own
`inputs_from` builds from the config and the upstream this module wires in: no stage's keys are
listed here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsspec.core import url_to_fs

from rlflow.engine.config.base import identity_mark
from rlflow.engine.config.schema import Config
from rlflow.engine.stages.catalog import stage_inputs
from rlflow.engine.stages.context import Record, StageOutcome
from rlflow.engine.stages.dpo import DPOUpstream
from rlflow.engine.stages.identity import ContentHasher, identity_of, identity_tree
from rlflow.engine.stages.inputs import LabelsInput, ModelInput, RewardModelInput
from rlflow.engine.stages.label import PAIRS_EVAL_FILE, PAIRS_FILE, LabelUpstream
from rlflow.engine.stages.reward_model import RewardModelUpstream, score_norm_from_metrics
from rlflow.engine.stages.rl.inputs import RLUpstream
from rlflow.engine.stages.round_eval import EvalUpstream
from rlflow.engine.stages.sft import SFTUpstream

PENDING = "pending:"  # a manifest sha256 that does not exist yet: the stage has still to run (the plan's)


@dataclass(frozen=True)
class PlannedStage:
    """A stage the round is about to run: where it is and what it is."""

    stage: str
    round_index: int
    identity: str
    identity_tree: dict[str, Any]


class RoundPlanner:
    """What `run_round` asks of its caller: each stage, given its upstream, run (the flow's
    flows/rounds.py TaskRunner) or read from its store (the plan's flows/plan.py StoreReader). Both
    compute the stage's identity with `planned`, from the inputs its own builder makes."""

    def __init__(self, config: Config):
        self.config = config
        self.content = ContentHasher(config.data.storage_options)

    def stage(self, stage: str, round_index: int, upstream: Record) -> StageOutcome:
        raise NotImplementedError

    def planned(self, stage: str, round_index: int, upstream: Record) -> PlannedStage:
        tree = identity_tree(stage, stage_inputs(self.config, stage, upstream), self.content)
        return PlannedStage(stage, round_index, identity_of(tree), tree)

    def model(self, value: str | StageOutcome) -> ModelInput:
        """A model input: a stage's output (its manifest), or a folder named by the config (its content)."""
        if isinstance(value, StageOutcome):
            return ModelInput(uri=value.checkpoint_uri, identity=value.manifest_sha256)
        return ModelInput(uri=value, identity=self.content.model(value))

    def data_fingerprints(self) -> dict[str, str]:
        """sha256 of every data file the config names, by data.<name> (a registered policy's lineage):
        the data.* fields marked by_content("file")."""
        data = self.config.data
        files = [n for n, f in type(data).model_fields.items() if (m := identity_mark(f)) and m.kind == "file"]
        return {n: self.content.file(getattr(data, n)).removeprefix("sha256:") for n in files if getattr(data, n)}


def reward_model_input(rm: StageOutcome | None) -> RewardModelInput | None:
    if rm is None:
        return None
    pending = rm.manifest_sha256.startswith(PENDING)  # no metrics yet: its identity stands for it anyway
    norm = (0.0, 1.0) if pending else score_norm_from_metrics(rm.metrics)
    return RewardModelInput(uri=rm.checkpoint_uri, identity=rm.manifest_sha256, score_norm=norm)


def labels_input(labelled: StageOutcome) -> LabelsInput:
    """A label stage's output: its pairs (none when it kept none) and held-out pairs."""
    m, uri = labelled.metrics, labelled.checkpoint_uri
    train = f"{uri}/{PAIRS_FILE}" if m.get("label/pairs", 0) > 0 else None
    held_out = f"{uri}/{PAIRS_EVAL_FILE}" if m.get("label/pairs_eval", 0) > 0 else None
    return LabelsInput(identity=labelled.manifest_sha256, train=train, held_out=held_out)


def human_labels(config: Config, round_index: int, content: ContentHasher) -> tuple[LabelsInput, ...]:
    """The human label files (`rlflow label import`) of rounds before this one, by content."""
    inbox = config.label.human_inbox
    if inbox is None:
        return ()
    options = config.data.storage_options
    fs, base = url_to_fs(f"{inbox.rstrip('/')}/{config.run.name}", **options)
    found = []
    for path in sorted(fs.glob(f"{base}/round_*.jsonl")):
        match = re.fullmatch(r"round_(\d+)\.jsonl", path.rsplit("/", 1)[-1])
        if match and int(match[1]) < round_index:
            url = fs.unstrip_protocol(path) if "://" in inbox else path
            found.append(LabelsInput(identity=content.file(url), train=url))
    return tuple(found)


@dataclass(frozen=True)
class RoundOutputs:
    final: StageOutcome  # the round's trained policy (RL or DPO): the candidate
    sft: StageOutcome | str  # the round's SFT policy (or the last one's, or model.path)
    rm: StageOutcome | None  # the round's reward model, if it trains one
    evaluation: StageOutcome


def run_round(
    config: Config,
    planner: RoundPlanner,
    r: int,
    policy: str | StageOutcome,
    sft: str | StageOutcome,
    labels: list[StageOutcome],
    rejected: StageOutcome | None = None,
) -> RoundOutputs:
    """One round: SFT (in sft.rounds), online labels (from label.online_from_round), then DPO, or the
    reward model (when a source is the round's model) and the RL stage, then the evaluation. `labels`
    grows by this round's. `rejected`: the last round's candidate when the promotion gates rejected it;
    the round starts from `policy` (the champion) but its online labels are pairs of the rejected
    policy's answers, the reward model's blind spot, which it must learn before the round retries."""
    c, model = config, planner.model
    if r in c.sft.rounds:
        sft = policy = planner.stage("sft", r, SFTUpstream(init=model(policy)))
    dpo = c.algorithm.name == "dpo"
    fresh = None
    if c.label.online_from_round is not None and r >= c.label.online_from_round and (dpo or c.reward.learned):
        # DPO learns from pairs of the policy it trains (online DPO), never from another's answers.
        answering = rejected if rejected is not None and not dpo else policy
        fresh = planner.stage("label", r, LabelUpstream(policy=model(answering)))
        labels.append(fresh)  # a reward model trains on the union of all rounds' labels
    rm = None
    if dpo:
        reference = sft if c.dpo.reference == "sft" else policy
        upstream = DPOUpstream(
            init=model(policy), reference=model(reference), labels=None if fresh is None else labels_input(fresh)
        )
        final = planner.stage("dpo", r, upstream)
    else:
        if c.reward.learned:
            init = sft if c.rm.init == "sft" else c.rm.init
            human = human_labels(c, r, planner.content)
            rm_labels = tuple(labels_input(labelled) for labelled in labels) + human
            rm = planner.stage("rm", r, RewardModelUpstream(init=model(init), labels=rm_labels))
        reference = sft if c.kl.reference == "sft" else policy
        critic = None if c.algorithm.critic_free else model(rm if c.ppo.critic_init == "rm" else policy)
        upstream = RLUpstream(
            policy=model(policy), reference=model(reference), sft=model(sft), reward_model=reward_model_input(rm),
            critic=critic,
        )
        final = planner.stage("rl", r, upstream)
    evaluated = EvalUpstream(
        start=model(policy), final=model(final), reference=model(reference), sft=model(sft),
        reward_model=reward_model_input(rm),
    )
    return RoundOutputs(final, sft, rm, planner.stage("eval", r, evaluated))


def run_rounds(
    config: Config, planner: RoundPlanner, promote: Callable[[int, RoundOutputs, float], bool]
) -> str | StageOutcome:
    """Every round in order, each starting from the champion. `promote(r, outputs, seconds)` is the
    caller's decision on round r's candidate, `seconds` the round's wall time: True, the next round
    starts from it; False, from what round r started from (its SFT policy if it ran SFT), with the
    rejected candidate passed on. Returns the policy the last round leaves as champion."""
    policy: str | StageOutcome = config.model.init_path
    sft: str | StageOutcome = config.model.init_path
    labels: list[StageOutcome] = []
    rejected: StageOutcome | None = None
    for r in range(config.run.rounds):
        started = time.monotonic()
        outputs = run_round(config, planner, r, policy, sft, labels, rejected)
        start = outputs.sft if r in config.sft.rounds else policy  # what the gates compared the candidate with
        sft = outputs.sft
        promoted = promote(r, outputs, time.monotonic() - started)
        policy, rejected = (outputs.final, None) if promoted else (start, outputs.final)
    return policy


def final_stage(config: Config) -> str:
    """The stage whose output is a round's trained policy: dpo under algorithm.name=dpo, else rl."""
    return "dpo" if config.algorithm.name == "dpo" else "rl"


def summary_row(r: int, rm: StageOutcome | None, evaluation: StageOutcome) -> dict[str, Any]:
    """The round's row of summary.json (and the promotion gates' input)."""
    m = evaluation.metrics
    return {
        "round": r,
        "rm_accuracy": None if rm is None else rm.metrics.get("rm/accuracy"),
        "rm_accuracy_online": None if rm is None else rm.metrics.get("rm/accuracy_online"),
        "gold_score_before": m["gold_score_before"],
        "gold_score_after": m["gold_score_after"],
        "gold_score_stderr": m["gold_score_stderr_after"],
        "kl": m["kl_after"],
        "response_length": m["response_length_after"],
        "distinct_2": m["distinct_2_after"],
        "valid_fraction": m["valid_fraction_after"],
        "response_length_before": m["response_length_before"],
        "distinct_2_before": m["distinct_2_before"],
        "valid_fraction_before": m["valid_fraction_before"],
        # paired on the same prompts and seed (absent from an evaluation cached before they existed)
        "gold_gain_stderr": m.get("gold_gain_stderr"),
        "valid_drop_stderr": m.get("valid_drop_stderr"),
        # reward.judge's scores, paired, and its agreement with the reward model (absent: no judge)
        "judge_score_before": m.get("judge_score_before"),
        "judge_score_after": m.get("judge_score_after"),
        "judge_gain_stderr": m.get("judge_gain_stderr"),
        "judge_agreement": m.get("judge_agreement"),
        # the fixed regression set's NLL per response token, paired (absent: no data.regression)
        "regression_nll_before": m.get("regression_nll_before"),
        "regression_nll_after": m.get("regression_nll_after"),
        "regression_nll_increase_stderr": m.get("regression_nll_increase_stderr"),
    }

