"""One round of the flow: which stages run (SFT, online labels, reward model, the RL stage or DPO,
evaluation), each one's identity, and what each passes on to the next.

Each stage's output checkpoint URI is passed explicitly to the next stage; each stage's identity
is computed here from its config subtree, its inputs' manifest hashes and its data fingerprints.
"""

from __future__ import annotations

import re
from typing import Any

from fsspec.core import url_to_fs

from rlflow.engine.config.schema import Config
from rlflow.engine.data.records import fingerprint_file
from rlflow.engine.models.identity import model_fingerprint
from rlflow.engine.stages.label_eval import PAIRS_EVAL_FILE, PAIRS_FILE
from rlflow.engine.config.secrets import redact
from rlflow.engine.stages.lifecycle import compute_identity
from rlflow.flows.breach import settle_breaches
from rlflow.tasks.stages import (
    StageResult,
    StageSpec,
    dpo_task,
    eval_task,
    label_task,
    output_exists,
    ppo_task,
    retryable,
    rm_task,
    sft_task,
)


class RoundPlanner:
    """Builds each stage's spec (identity) from the config and the upstream results."""

    def __init__(self, config: Config, parent_run_id: str):
        self.config, self.parent_run_id = config, parent_run_id
        self._fingerprints: dict[str, str] = {}  # data files, hashed once each, only if a stage reads them

    @property
    def fingerprints(self) -> dict[str, str]:
        """sha256 of every data file a planned stage reads, by data.<name>."""
        return dict(self._fingerprints)

    def fingerprint(self, name: str) -> str:
        if name not in self._fingerprints:
            data = self.config.data
            url = getattr(data, name)  # None: the config names no such file (data.preferences: null)
            self._fingerprints[name] = "none" if url is None else fingerprint_file(url, data.storage_options)
        return self._fingerprints[name]

    def spec(
        self, stage: str, round_index: int, sections: dict[str, Any], inputs: dict[str, str], data: tuple[str, ...]
    ) -> StageSpec:
        items = sections.items()
        tree = {
            "stage": stage,
            "seed": self.config.run.seed,
            # Redacted: the tree is stored in every manifest, and a credential (a judge's api_key)
            # rotating must not make a finished stage "changed".
            "config": redact({k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in items}),
            "inputs": inputs,
            "data": {name: self.fingerprint(name) for name in data},
        }
        if stage in ("label", "ppo", "eval"):  # the stages that encode prompts
            tree["data_options"] = {k: getattr(self.config.data, k) for k in ("max_prompt_tokens", "prompt_overflow")}
        return StageSpec(
            stage=stage,
            round_index=round_index,
            identity=compute_identity(tree),
            identity_tree=tree,
            parent_run_id=self.parent_run_id,
        )


def run_stage(task_fn: Any, config: Config, spec: StageSpec, *args: Any) -> StageResult:
    """Call a stage task with its retry policy (stage.retries; each retry resumes from the last
    checkpoint); a cached result whose checkpoint is gone (deleted or pruned by hand) is not
    trusted: the task runs again with the cache refreshed. A breach (never cached) is returned
    as it is: the caller settles it (flows/breach.py)."""
    policy = config.stage.policy(spec.stage)
    task_fn = task_fn.with_options(
        retries=policy.retries, retry_delay_seconds=policy.retry_delay_s, retry_condition_fn=retryable
    )
    result = task_fn(config, spec, *args)
    if result.breach is None and not output_exists(config, result):
        result = task_fn.with_options(refresh_cache=True)(config, spec, *args)
    return result


def _input_id(value: str | StageResult) -> str:
    return value.manifest_sha256 if isinstance(value, StageResult) else model_fingerprint(value)


def _uri(value: str | StageResult) -> str:
    return value.checkpoint_uri if isinstance(value, StageResult) else value


def run_round(
    config: Config,
    planner: RoundPlanner,
    r: int,
    policy: str | StageResult,
    sft: str | StageResult,
    labels: list[StageResult],
    rejected: StageResult | None = None,
) -> tuple[StageResult, StageResult | str, StageResult | None, dict[str, Any]]:
    """One round; returns (final policy, SFT policy, reward model or None, summary row). `labels`
    grows by this round's. The round trains with DPO (algorithm.name=dpo) or an RL stage.
    `rejected`: the last round's candidate when the promotion gates rejected it; the round starts
    from `policy` (the champion) but its reward model's online labels are pairs of the rejected
    policy's answers, the reward model's blind spot, which it must learn before the round retries."""
    c = config
    if r in c.sft.rounds:
        spec = planner.spec(
            "sft",
            r,
            {"sft": c.sft.model_dump(exclude={"rounds", "log_every"}), "model": model_section_of(c)},
            {"init": _input_id(policy)},
            ("sft", "sft_eval"),
        )
        sft = policy = run_stage(sft_task, c, spec, _uri(policy))
    dpo = c.algorithm.name == "dpo"
    online = c.label.online_from_round is not None and r >= c.label.online_from_round
    fresh = None
    if online and (dpo or c.reward.learned):
        # DPO learns from pairs of the policy it trains (online DPO), never from another's answers.
        answering = rejected if rejected is not None and not dpo else policy
        spec = planner.spec(
            "label",
            r,
            {"label": _label_section(c), "sampling": c.sampling},
            {"policy": _input_id(answering)},
            ("prompts",),
        )
        fresh = run_stage(label_task, c, spec, _uri(answering))
        labels.append(fresh)  # a reward model trains on the union of all rounds' labels
    if dpo:
        rm, reference = None, (sft if c.dpo.reference == "sft" else policy)
        final = dpo_stage(c, planner, r, policy, reference, fresh)
    else:
        rm = reward_model_stage(c, planner, r, sft, labels) if c.reward.learned else None
        reference = sft if c.kl.reference == "sft" else policy
        final = rl_stage(c, planner, r, policy, reference, sft, rm)
    upstream = (("policy", policy), ("reference", reference), ("sft", sft)) + ((("rm", rm),) if rm else ())
    eval_spec = planner.spec(
        "eval",
        r,
        {"eval": c.eval, "gold": c.gold, "sampling": c.sampling, "model": model_section_of(c)}
        | ({"env": c.env.model_dump(mode="json", exclude={"tool_workers"})} if c.env is not None else {})
        | ({"valid_rule": _source_definition(c, c.reward.valid)} if c.reward.valid is not None else {})
        | ({"judge": _source_definition(c, c.reward.judge)} if c.reward.judge is not None else {}),
        {k: _input_id(v) for k, v in upstream + (("final", final),)},
        ("eval_prompts",) + (("regression",) if c.data.regression is not None else ()),
    )
    inputs = {"policy": _uri(policy), "reference": _uri(reference), "sft": _uri(sft), "final": final.checkpoint_uri}
    evaluation = run_stage(eval_task, c, eval_spec, inputs, rm)
    return final, sft, rm, _summary_row(r, rm, evaluation)


def _source_definition(c: Config, name: str) -> dict[str, Any]:
    """A declared rule or judge (reward.valid, reward.judge) as the evaluation's identity sees it:
    its definition, not its name or weight."""
    source = next(s for s in c.reward.sources if s.name == name)
    return source.model_dump(mode="json", exclude={"weight", "name"})


def rl_stage(
    c: Config,
    planner: RoundPlanner,
    r: int,
    policy: str | StageResult,
    reference: str | StageResult,
    sft: str | StageResult,
    rm: StageResult | None,
) -> StageResult:
    """The RL stage (PPO, GRPO, RLOO, REINFORCE++; named "ppo" whatever the estimator), with an
    operator's decisions after a breach."""
    upstream = (("policy", policy), ("reference", reference), ("sft", sft)) + ((("rm", rm),) if rm else ())
    spec = planner.spec(
        "ppo",
        r,
        {
            "ppo": c.ppo.model_dump(exclude={"log_every"}),
            # The breaker's keys are not: continuing a paused stage with a new limit is the same stage.
            "kl": c.kl.model_dump(exclude={"pause_above", "pause_patience"}),
            "sampling": c.sampling,
            "algorithm": c.algorithm,
            "rollout_n": c.rollout.n,
            "reward_sources": [s.model_dump(mode="json") for s in c.reward.sources],
            "reward_overlong": [c.reward.overlong_buffer, c.reward.overlong_penalty],
            **({"uncertainty_penalty": c.reward.uncertainty_penalty} if c.reward.uncertainty_penalty else {}),
            **({"valid_rule": c.reward.valid} if c.reward.valid is not None else {}),
            **({"hacking": c.hacking.model_dump(mode="json") | {"judge": c.reward.judge}} if c.hacking.enabled else {}),
            "eval": c.eval,
            "gold": c.gold,
            "keep_best": [c.checkpoint.keep_best, c.checkpoint.keep_best_mode],
            "model": model_section_of(c),
            # Off-policy sampling changes what is trained on; k=0 keeps the synchronous identities.
            **({"rollout_off_policy_steps": c.rollout.off_policy_steps} if c.rollout.off_policy_steps else {}),
            **({"rollout_async": [c.rollout.max_staleness, c.rollout.partial_rollouts]} if c.rollout.async_ else {}),
            **({"env": c.env.model_dump(mode="json", exclude={"tool_workers"})} if c.env is not None else {}),  # single-turn keeps its identity
        },
        {k: _input_id(v) for k, v in upstream},
        ("prompts", "eval_prompts"),
    )
    inputs = {"policy": _uri(policy), "reference": _uri(reference), "sft": _uri(sft)}
    result = run_stage(ppo_task, c, spec, inputs, rm)
    return settle_breaches(c, result, lambda overrides: run_stage(ppo_task, c, spec, inputs, rm, overrides))


def dpo_stage(
    c: Config,
    planner: RoundPlanner,
    r: int,
    policy: str | StageResult,
    reference: str | StageResult,
    fresh: StageResult | None,
) -> StageResult:
    """DPO on the offline preferences (dpo.include_offline) and this round's fresh pairs, labelled
    from the round's starting policy (online DPO)."""
    files = [f"{fresh.checkpoint_uri}/{PAIRS_FILE}"] if fresh and fresh.metrics.get("label/pairs", 0) > 0 else []
    inputs = {"init": _input_id(policy), "reference": _input_id(reference)}
    if fresh is not None:
        inputs["labels"] = fresh.manifest_sha256
    data = ("preferences", "preferences_eval") if c.dpo.include_offline else ("preferences_eval",)
    spec = planner.spec(
        "dpo", r, {"dpo": c.dpo.model_dump(exclude={"log_every"}), "model": model_section_of(c)}, inputs, data
    )
    return run_stage(dpo_task, c, spec, _uri(policy), _uri(reference), files)


def reward_model_stage(
    c: Config, planner: RoundPlanner, r: int, sft: str | StageResult, labels: list[StageResult]
) -> StageResult:
    """The round's reward model: offline preferences, every online label stage so far and the
    human labels of earlier rounds."""
    rm_init = sft if c.rm.init == "sft" else c.rm.init
    human = human_label_files(c, r)
    rm_inputs = {"init": _input_id(rm_init), "labels": ",".join(l.manifest_sha256 for l in labels)}
    if human:  # only then: runs without human labels keep their identities
        # Names and hashes, not URLs: a moved project or another mount is not a change.
        rm_inputs["human"] = ",".join(f"{url.rsplit('/', 1)[-1]}@{fp}" for url, fp in human.items())
    rm_spec = planner.spec(
        "rm",
        r,
        # One head keeps the identities of runs from before rm.ensemble existed.
        {"rm": c.rm.model_dump(exclude={"log_every"} | (set() if c.rm.ensemble > 1 else {"ensemble"})),
         "model": model_section_of(c)},
        rm_inputs,
        ("preferences", "preferences_eval", "sft"),
    )
    online = [f"{l.checkpoint_uri}/{PAIRS_FILE}" for l in labels if l.metrics.get("label/pairs", 0) > 0]
    held_out = [f"{l.checkpoint_uri}/{PAIRS_EVAL_FILE}" for l in labels if l.metrics.get("label/pairs_eval", 0) > 0]
    return run_stage(rm_task, c, rm_spec, _uri(rm_init), online + list(human), held_out)


def _label_section(c: Config) -> dict[str, Any]:
    """The label keys in the label stage's identity; eval_fraction only when set, so runs from
    before it existed keep their identities."""
    return c.label.model_dump(exclude={"human_inbox"} | (set() if c.label.eval_fraction else {"eval_fraction"}))


def model_section_of(c: Config) -> dict[str, Any]:
    """The model keys in a stage's identity; `lora` only when set, so runs from before it existed
    keep their identities."""
    return c.model.model_dump(exclude={"path"} | ({"lora"} if c.model.lora is None else set()))


def human_label_files(config: Config, round_index: int) -> dict[str, str]:
    """{url: sha256} of the human label files (`rlflow label import`) of rounds before this one."""
    inbox = config.label.human_inbox
    if inbox is None:
        return {}
    fs, base = url_to_fs(f"{inbox.rstrip('/')}/{config.run.name}", **config.data.storage_options)
    found = {}
    for path in sorted(fs.glob(f"{base}/round_*.jsonl")):
        match = re.fullmatch(r"round_(\d+)\.jsonl", path.rsplit("/", 1)[-1])
        if match and int(match[1]) < round_index:
            url = fs.unstrip_protocol(path) if "://" in inbox else path
            found[url] = fingerprint_file(url, config.data.storage_options)
    return found



def _summary_row(r: int, rm: StageResult | None, evaluation: StageResult) -> dict[str, Any]:
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


def lineage_tags(planner: RoundPlanner, policy: StageResult, rm: StageResult | None) -> dict[str, str]:
    """What a registered policy came from: its checkpoint, runs, reward model and data."""
    tags = {
        "rlflow.checkpoint_uri": policy.checkpoint_uri,
        "rlflow.manifest_sha256": policy.manifest_sha256,
        "rlflow.parent_run_id": planner.parent_run_id,
        "rlflow.ppo_run_id": policy.mlflow_run_id or "",
        "rlflow.reward_model_run_id": (rm.mlflow_run_id or "") if rm else "",
        "rlflow.reward_model_uri": rm.checkpoint_uri if rm else "",
        "rlflow.algorithm": planner.config.algorithm.name,
        "rlflow.run_name": planner.config.run.name,
    }
    return tags | {f"rlflow.data.{name}": fp for name, fp in planner.fingerprints.items()}
