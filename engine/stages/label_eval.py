"""The two short stages around training: online labelling before the reward model, and the
round's evaluation of its starting and final policy."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from rlflow.engine.algorithms.stats import paired_difference, sign_agreement
from rlflow.engine.data.batching import PromptResponseIds, batch_indices, encode_pair
from rlflow.engine.config.schema import DataConfig
from rlflow.engine.config.stages import EvalConfig
from rlflow.engine.config.model import ModelConfig
from rlflow.engine.config.env import EnvConfig
from rlflow.engine.data.records import PromptRecord, load_prompts, load_sft_examples
from rlflow.engine.rewards.model_scores import ScoreNorm, ScoringModels
from rlflow.engine.stages.evaluation import (
    REGRESSION_MAX_TOKENS,
    PolicyEvaluation,
    encode_prompt_set,
    evaluate_policy,
    response_nll_by_row,
)
from rlflow.engine.models.loading import load_policy, load_scalar_model, load_tokenizer
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.episodes import EpisodeSampler
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.stages.context import StageContext, StageOutcome
from rlflow.engine.stages.lifecycle import completed_outcome, finish
from rlflow.engine.seeds import step_seed

PAIRS_FILE = "pairs.jsonl"
PAIRS_EVAL_FILE = "pairs_eval.jsonl"  # held out of reward-model training (label.eval_fraction)
RESULTS_FILE = "results.json"


def sample_answer_pairs(
    policy_path: str,
    model_cfg: ModelConfig,
    data: DataConfig,
    sampling: SamplingParams,
    n_prompts: int,
    seed: int,
    round_index: int,
) -> list[tuple[PromptRecord, str, str]]:
    """(prompt record, answer A, answer B) for `n_prompts` of data.prompts, each answered twice
    by the policy: what a labeller (a function, or raters after `rlflow label export`) compares.
    The prompts and draws are a function of (seed, round)."""
    tokenizer = load_tokenizer(policy_path, model_cfg.trust_remote_code, chat_template=data.chat_template)
    policy = load_policy(policy_path, model_cfg.dtype, model_cfg.trust_remote_code).eval()
    records = load_prompts(data.prompts, data.storage_options)
    chosen_idx = batch_indices(len(records), min(n_prompts, len(records)), 1, seed, round_index, 6)
    prompts, _, _ = encode_prompt_set(
        tokenizer, [records[i] for i in chosen_idx], data.max_prompt_tokens, data.prompt_overflow, data.prompts
    )
    answers = []
    for draw in (0, 1):
        texts: list[str] = []
        for start in range(0, len(prompts.token_ids), 128):
            batch = generate_rollouts(
                policy,
                tokenizer,
                prompts.token_ids[start : start + 128],
                sampling,
                step_seed(seed, round_index, draw, start, 8),
            )
            texts.extend(batch.response_texts)
        answers.append(texts)
    return list(zip(prompts.records, *answers))


@dataclass(frozen=True)
class LabelStageInputs:
    """What the online-label stage needs, built once by its task."""

    policy_path: str  # the policy that answers (a local directory)
    model: ModelConfig
    data: DataConfig
    sampling: SamplingParams
    labeller: Callable[..., Any]  # label.labeller.fn: (prompt, a, b, rng=..., **kwargs, **fields) -> 0 | 1 | None
    labeller_kwargs: dict[str, Any]
    n_prompts: int  # prompts answered twice
    eval_fraction: float = 0.0  # share of the pairs held out as pairs_eval.jsonl


def run_label_stage(ctx: StageContext, inputs: LabelStageInputs) -> StageOutcome:
    """The current policy answers `n_prompts` prompts twice; the labeller picks one (ties dropped).

    Writes the labelled pairs (prompt, chosen, rejected) in the stage's step 0: `pairs.jsonl` for
    training and, with `eval_fraction` > 0, that share of them as `pairs_eval.jsonl` instead.
    """
    if (done := completed_outcome(ctx)) is not None:
        return done
    labeller, labeller_kwargs, eval_fraction = inputs.labeller, inputs.labeller_kwargs, inputs.eval_fraction
    triples = sample_answer_pairs(
        inputs.policy_path, inputs.model, inputs.data, inputs.sampling, inputs.n_prompts, ctx.seed, ctx.round_index
    )
    rng = random.Random(step_seed(ctx.seed, ctx.round_index, 9))
    rows, ties, empty = [], 0, 0
    for record, a, b in triples:
        if not a.strip() or not b.strip():  # preference data holds non-empty answers only
            empty += 1
            continue
        choice = labeller(record.prompt, a, b, rng=rng, **labeller_kwargs, **record.fields)
        if choice is None:
            ties += 1
            continue
        chosen, rejected = (a, b) if choice == 0 else (b, a)
        rows.append({"prompt": record.prompt, "chosen": chosen, "rejected": rejected})
    # Its own stream: the labeller's draws (and so the pairs) do not depend on the split.
    split = random.Random(step_seed(ctx.seed, ctx.round_index, 11))
    held = set(split.sample(range(len(rows)), round(len(rows) * eval_fraction)))
    train = [row for i, row in enumerate(rows) if i not in held]
    held_out = [row for i, row in enumerate(rows) if i in held]
    with ctx.store.writer(0) as writer:
        writer.write_bytes(PAIRS_FILE, _jsonl(train))
        if eval_fraction > 0:
            writer.write_bytes(PAIRS_EVAL_FILE, _jsonl(held_out))
        writer.meta["identity"] = ctx.identity
    metrics = {"label/pairs": float(len(train)), "label/ties_dropped": float(ties), "label/empty_dropped": float(empty)}
    if eval_fraction > 0:
        metrics["label/pairs_eval"] = float(len(held_out))
    ctx.sink.log_metrics(metrics, 0)
    return finish(ctx, 0, metrics, None)


def _jsonl(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@dataclass(frozen=True)
class EvalInputs:
    start_policy: str  # the round's starting policy (its "before")
    final_policy: str  # the round's PPO policy (its "after")
    reference: str
    sft: str
    reward_model: str | None  # None: the round trained no reward model
    score_norm: ScoreNorm | None


@dataclass(frozen=True)
class EvalStageInputs:
    """What the evaluation stage needs, built once by its task."""

    paths: EvalInputs
    model: ModelConfig
    data: DataConfig
    eval: EvalConfig
    sampling: SamplingParams  # eval.sampling(ppo): greedy with eval.greedy
    gold: Callable[..., Any]  # gold.fn, bound to its kwargs
    env: EnvConfig | None = None  # env.*: each prompt is an episode of this environment, scored on its answer
    valid: Callable[..., float] | None = None  # reward.valid's rule (eval/valid_fraction); None: the gold's
    judge: Callable[..., float] | None = None  # reward.judge as a rule or function (eval/judge_*)
    judge_model: str | None = None  # reward.judge as a second reward model: its folder (raw scores)


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


def _regression_rows(tokenizer: Any, data: DataConfig) -> list[PromptResponseIds]:
    """data.regression's records, encoded as SFT encodes its pairs (none without the file)."""
    if data.regression is None:
        return []
    examples = load_sft_examples(data.regression, data.storage_options)  # an empty file: a DataError naming it
    return [encode_pair(tokenizer, ex.prompt, ex.response, REGRESSION_MAX_TOKENS, ex.tools) for ex in examples]


def run_eval_stage(ctx: StageContext, stage_inputs: EvalStageInputs) -> StageOutcome:
    """Evaluate the start (step 0 of the metrics) and final (step 1) policy on the same prompts
    with the same sampling seed; the outcome holds both as gold_score_before/after etc."""
    if (done := completed_outcome(ctx)) is not None:
        return done
    inputs, model_cfg, data, eval_cfg = stage_inputs.paths, stage_inputs.model, stage_inputs.data, stage_inputs.eval
    sampling, gold = stage_inputs.sampling, stage_inputs.gold
    kw = {"dtype": model_cfg.dtype, "trust_remote_code": model_cfg.trust_remote_code}
    tokenizer = load_tokenizer(inputs.final_policy, model_cfg.trust_remote_code, chat_template=data.chat_template)
    reference = load_policy(inputs.reference, **kw).eval()
    scoring = ScoringModels(
        reward_model=None if inputs.reward_model is None else load_scalar_model(inputs.reward_model, **kw).eval(),
        score_norm=inputs.score_norm,
        reference=reference,
        sft=reference if inputs.sft == inputs.reference else load_policy(inputs.sft, **kw).eval(),
        gold=gold,
        valid=stage_inputs.valid,
        judge=stage_inputs.judge,
        judge_model=None if (judge := stage_inputs.judge_model) is None else load_scalar_model(judge, **kw).eval(),
    )
    records = load_prompts(data.eval_prompts, data.storage_options)[: eval_cfg.num_prompts]
    episodes = None if stage_inputs.env is None else EpisodeSampler(stage_inputs.env, tokenizer, None,
                                                                     data.max_prompt_tokens)
    prompts, _, _ = encode_prompt_set(
        tokenizer, records, data.max_prompt_tokens, data.prompt_overflow, data.eval_prompts, episodes
    )
    results: dict[str, Any] = {}
    measured = []
    regression_rows = _regression_rows(tokenizer, data)
    regression: list[tuple[float, ...]] = []  # [before, after] each row's NLL (nats per response token)
    for step, (name, path) in enumerate((("before", inputs.start_policy), ("after", inputs.final_policy))):
        policy = load_policy(path, **kw).eval()
        evaluation = evaluate_policy(
            policy,
            tokenizer,
            prompts,
            scoring,
            sampling,
            step_seed(ctx.seed, ctx.round_index, 10),
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
    with ctx.store.writer(0) as writer:
        writer.write_json(RESULTS_FILE, results)
        writer.meta["identity"] = ctx.identity
    before, after = results["before"]["metrics"], results["after"]["metrics"]
    summary = {f"{k.removeprefix('eval/')}_before": v for k, v in before.items()}
    summary |= {f"{k.removeprefix('eval/')}_after": v for k, v in after.items()}
    summary |= {k.removeprefix("eval/"): v for k, v in paired.items()}
    return finish(ctx, 0, summary, None)
