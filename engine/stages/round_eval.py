"""The round's evaluation stage: its starting and its final policy measured on the same held-out
prompts with the same sampling seed, and the paired differences the promotion gates read."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

from rlflow.engine.algorithms.stats import paired_difference, sign_agreement
from rlflow.engine.config.base import FunctionRef, SectionView
from rlflow.engine.config.env import EnvConfig
from rlflow.engine.config.methods import RewardSourceConfig
from rlflow.engine.config.sampling import SamplingConfig
from rlflow.engine.config.schema import Config, DataConfig
from rlflow.engine.config.stages import EvalConfig
from rlflow.engine.data.batching import PromptResponseIds, encode_pair
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.data.records import load_prompts, load_sft_examples
from rlflow.engine.models.loading import load_policy, load_scalar_model, load_tokenizer
from rlflow.engine.rewards.model_scores import ScoringModels
from rlflow.engine.rewards.sources import named_source, source_scorer
from rlflow.engine.rewards.user_functions import load_bound_function
from rlflow.engine.rollout.episodes import EpisodeSampler
from rlflow.engine.seeds import step_seed
from rlflow.engine.stages.context import Record, StageContext, StageOutcome
from rlflow.engine.stages.evaluation import (
    REGRESSION_MAX_TOKENS,
    PolicyEvaluation,
    evaluate_policy,
    response_nll_by_row,
)
from rlflow.engine.stages.inputs import ModelInput, ModelLoading, RewardModelInput, StageInputs
from rlflow.engine.stages.lifecycle import finish

RESULTS_FILE = "results.json"
BY_PROMPT_TABLE = "eval_gold_by_prompt.json"  # each prompt's gold before and after (`rlflow compare` pairs runs)


class EvalData(SectionView, source=DataConfig):
    """The data.* keys the evaluation reads."""

    eval_prompts: str
    regression: str | None
    max_prompt_tokens: int
    prompt_overflow: Literal["truncate", "drop"]
    chat_template: Literal["auto", "none"]
    storage_options: dict[str, Any]


class DeclaredSources(Record):
    """The reward sources an evaluation scores with besides the gold: reward.valid and reward.judge."""

    valid: RewardSourceConfig | None  # the declared valid rule (eval/valid_fraction); None: the gold's
    judge: RewardSourceConfig | None  # the independent judge (eval/judge_*); None: none
    on_error: Literal["fail", "skip"]  # reward.on_error, what a failing rule does


class EvalUpstream(Record):
    start: ModelInput  # the round's starting policy (its "before")
    final: ModelInput  # the round's trained policy (its "after")
    reference: ModelInput  # the RL stage's KL anchor (eval/kl)
    sft: ModelInput  # the round's SFT policy (eval/kl_to_sft)
    reward_model: RewardModelInput | None = None  # None: the round trained no reward model


class EvalInputs(StageInputs):
    """Everything the evaluation stage reads."""

    upstream: EvalUpstream
    model: ModelLoading
    data: EvalData
    eval: EvalConfig
    sampling: SamplingConfig  # what it samples with, unless eval.greedy
    gold: FunctionRef
    env: EnvConfig | None  # each prompt an episode of this environment, scored on its answer
    reward: DeclaredSources


def inputs_from(config: Config, upstream: EvalUpstream) -> EvalInputs:
    reward = config.reward
    declared = DeclaredSources(
        valid=named_source(reward, reward.valid), judge=named_source(reward, reward.judge), on_error=reward.on_error
    )
    return EvalInputs(
        seed=config.run.seed,
        upstream=upstream,
        model=ModelLoading.for_stage(config.model, "eval"),
        data=EvalData.of(config.data),
        eval=config.eval,
        sampling=config.sampling,
        gold=config.gold,
        env=config.env,
        reward=declared,
    )


def paired_metrics(before: PolicyEvaluation, after: PolicyEvaluation) -> dict[str, float]:
    """The change from `before` to `after`, paired on the same prompts and sampling seed, with the
    standard error of the per-prompt differences: eval/gold_gain (+ _stderr; after minus before)
    and eval/valid_drop (+ _stderr; before minus after). With a judge (reward.judge) also
    eval/judge_gain (+ _stderr) and, with a reward model, eval/judge_agreement: on the prompts where
    both tell the two answers apart, the share where the judge agrees with the reward model on which
    is better (eval/judge_agreement_n of them). A hacked reward model prefers answers the judge
    does not: its agreement falls towards 0."""
    gain, gain_se = paired_difference(before.gold_scores, after.gold_scores)
    drop, drop_se = paired_difference(after.valid, before.valid)
    metrics = {
        "eval/gold_gain": gain,
        "eval/gold_gain_stderr": gain_se,
        "eval/valid_drop": drop,
        "eval/valid_drop_stderr": drop_se,
    }
    if before.judge is None or after.judge is None:
        return metrics
    judge_gain, judge_se = paired_difference(before.judge, after.judge)
    metrics |= {"eval/judge_gain": judge_gain, "eval/judge_gain_stderr": judge_se}
    if before.rm_scores is not None and after.rm_scores is not None:
        share, n = sign_agreement(before.rm_scores, after.rm_scores, before.judge, after.judge)
        metrics["eval/judge_agreement_n"] = float(n)
        if share is not None:
            metrics["eval/judge_agreement"] = share
    return metrics


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A short name of one prompt as the model read it: two runs' scores pair only on equal digests."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def gold_by_prompt(
    prompt_ids: Sequence[Sequence[int]], before: PolicyEvaluation, after: PolicyEvaluation
) -> list[dict[str, Any]]:
    """A row per prompt, in order: its digest and its gold score before and after the round. Two runs
    evaluated on the same prompts compare per prompt (a paired difference), not by their means."""
    return [
        {"prompt": prompt_digest(ids), "gold_before": b, "gold_after": a}
        for ids, b, a in zip(prompt_ids, before.gold_scores, after.gold_scores, strict=True)
    ]


def _regression_rows(tokenizer: Any, data: EvalData) -> list[PromptResponseIds]:
    """data.regression's records, encoded as SFT encodes its pairs (none without the file)."""
    if data.regression is None:
        return []
    examples = load_sft_examples(data.regression, data.storage_options)  # an empty file: a DataError naming it
    return [encode_pair(tokenizer, ex.prompt, ex.response, REGRESSION_MAX_TOKENS, ex.tools) for ex in examples]


def _scoring_models(inputs: EvalInputs, kw: dict[str, Any]) -> ScoringModels:
    """The models and rules every answer is scored with: the reward model, the KL anchors, the gold,
    the declared valid rule and the judge (a rule, a function or a second reward model)."""
    up, declared = inputs.upstream, inputs.reward
    reference = load_policy(up.reference.uri, **kw).eval()
    judge = declared.judge
    judge_model = judge.path if judge is not None and judge.type == "model" else None
    return ScoringModels(
        reward_model=None if up.reward_model is None else load_scalar_model(up.reward_model.uri, **kw).eval(),
        score_norm=None if up.reward_model is None else up.reward_model.score_norm,
        reference=reference,
        sft=reference if up.sft.uri == up.reference.uri else load_policy(up.sft.uri, **kw).eval(),
        gold=load_bound_function(inputs.gold, "gold.fn"),
        valid=source_scorer(declared.valid, declared.on_error),
        judge=source_scorer(judge, declared.on_error),
        judge_model=None if judge_model is None else load_scalar_model(judge_model, **kw).eval(),
    )


def run_eval_stage(ctx: StageContext, inputs: EvalInputs) -> StageOutcome:
    """Evaluate the start (step 0 of the metrics) and final (step 1) policy on the same prompts
    with the same sampling seed; the outcome holds both as gold_score_before/after etc."""
    model_cfg, data, eval_cfg, up = inputs.model, inputs.data, inputs.eval, inputs.upstream
    sampling = inputs.sampling.params(greedy=eval_cfg.greedy)
    kw = {"dtype": model_cfg.dtype, "trust_remote_code": model_cfg.trust_remote_code}
    tokenizer = load_tokenizer(up.final.uri, model_cfg.trust_remote_code, chat_template=data.chat_template)
    scoring = _scoring_models(inputs, kw)
    records = load_prompts(data.eval_prompts, data.storage_options)[: eval_cfg.num_prompts]
    episodes = None if inputs.env is None else EpisodeSampler(inputs.env, tokenizer, None, data.max_prompt_tokens)
    prompts, _, _ = encode_prompt_set(
        tokenizer, records, data.max_prompt_tokens, data.prompt_overflow, data.eval_prompts, episodes
    )
    results: dict[str, Any] = {}
    measured = []
    regression_rows = _regression_rows(tokenizer, data)
    regression: list[tuple[float, ...]] = []  # [before, after] each row's NLL (nats per response token)
    for step, (name, path) in enumerate((("before", up.start.uri), ("after", up.final.uri))):
        policy = load_policy(path, **kw).eval()
        evaluation = evaluate_policy(
            policy,
            tokenizer,
            prompts,
            scoring,
            sampling,
            step_seed(inputs.seed, ctx.round_index, 10),
            eval_cfg.batch_size,
            eval_cfg.num_logged_samples,
            episodes=episodes,
        )
        if regression_rows:
            regression.append(response_nll_by_row(policy, regression_rows, tokenizer.pad_token_id))
            evaluation.metrics["eval/regression_nll"] = sum(regression[-1]) / len(regression[-1])
        ctx.sink.log_metrics(evaluation.metrics, step)
        ctx.sink.log_table(f"eval_samples_{name}.json", evaluation.samples)
        results[name] = {"metrics": evaluation.metrics, "samples": evaluation.samples}
        measured.append(evaluation)
    paired = paired_metrics(*measured)
    if regression:
        increase, increase_se = paired_difference(*regression)
        paired |= {"eval/regression_nll_increase": increase, "eval/regression_nll_increase_stderr": increase_se}
    ctx.sink.log_metrics(paired, 1)
    results["paired"] = paired
    results["by_prompt"] = gold_by_prompt(prompts.token_ids, *measured)
    ctx.sink.log_table(BY_PROMPT_TABLE, results["by_prompt"])
    with ctx.store.writer(0) as writer:
        writer.write_json(RESULTS_FILE, results)
        writer.meta.update(identity=ctx.identity, identity_tree=ctx.identity_tree)
    before, after = results["before"]["metrics"], results["after"]["metrics"]
    summary = {f"{k.removeprefix('eval/')}_before": v for k, v in before.items()}
    summary |= {f"{k.removeprefix('eval/')}_after": v for k, v in after.items()}
    summary |= {k.removeprefix("eval/"): v for k, v in paired.items()}
    return finish(ctx, 0, summary, None)
