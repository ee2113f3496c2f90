"""Evaluating a policy: gold score, reward-model score, KL, length and diversity of its answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engine.algorithms.kl import token_kl
from rlflow.engine.algorithms.stats import distinct_n, masked_mean, mean_and_stderr
from rlflow.engine.backend import dist
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.data.prompts import PromptSet
from rlflow.engine.data.records import PromptRecord
from rlflow.engine.rewards.model_scores import ScoringModels, ensemble_mean_std, normalised_head_scores
from rlflow.engine.rewards.user_functions import GoldScores, score_answers
from rlflow.engine.rollout.episodes import EpisodeSampler, episode_metrics
from rlflow.engine.data.batching import PromptResponseIds, right_pad
from rlflow.engine.models.lm_head import next_token_logprobs
from rlflow.engine.models.loading import head_columns, model_device, position_ids_from_mask
from rlflow.engine.rollout.generate import batched_logprobs, batched_scores, generate_rollouts


@dataclass(frozen=True)
class PolicyEvaluation:
    """One policy measured on a prompt set (evaluate_policy)."""

    metrics: dict[str, float]  # eval/* (see evaluate_policy)
    samples: list[dict[str, Any]]  # the first n_samples prompts: prompt, response, scores (the logged table)
    gold_scores: tuple[float, ...]  # [n_prompts] each prompt's gold score, in prompt order
    valid: tuple[float, ...]  # [n_prompts] 1.0 where the answer is valid, else 0.0 (eval/valid_fraction's terms)
    judge: tuple[float, ...] | None = None  # [n_prompts] reward.judge's score of each answer; None: no judge
    rm_scores: tuple[float, ...] | None = None  # [n_prompts] the reward model's normalised score; None: none


REGRESSION_MAX_TOKENS = 1024  # a data.regression record longer than this keeps its prompt's last tokens


@torch.no_grad()
def response_nll_by_row(
    model: torch.nn.Module, rows: Sequence[PromptResponseIds], pad_id: int, batch_size: int = 32
) -> tuple[float, ...]:
    """[len(rows)] each row's mean next-token NLL over its response tokens (nats per token).

    Every rank scores every row (the same passes on each, as ZeRO-3's gathers need)."""
    scores: list[float] = []
    device = model_device(model)
    for start in range(0, len(rows), batch_size):
        ids, attention, response_mask = (t.to(device) for t in right_pad(rows[start : start + batch_size], pad_id))
        forward = {"attention_mask": attention, "position_ids": position_ids_from_mask(attention), "use_cache": False}
        logprobs, _ = next_token_logprobs(model, ids, forward, 1)
        mask = response_mask[:, 1:]
        scores += (-(logprobs * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    return tuple(scores)


@torch.no_grad()
def evaluate_policy(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: PromptSet,
    models: ScoringModels,
    sampling: SamplingParams,
    seed: int,
    batch_size: int = 128,
    n_samples: int = 12,
    generate_kwargs: dict[str, Any] | None = None,
    episodes: EpisodeSampler | None = None,
) -> PolicyEvaluation:
    """Sample one answer per prompt and measure it.

    Prompts go in chunks of `batch_size`, each seeded from (seed, its start) and spread over the
    ranks, so the answers are the same for any number of processes.

    Metrics: eval/gold_score (+ _stderr and eval/gold/<component>), eval/rm_score (an ensemble's
    mean; its heads' std: eval/rm_score_std_ensemble), eval/kl and
    eval/kl_to_sft (token-mean k3 estimate on the sampled tokens), eval/response_length (tokens),
    eval/distinct_2 (pooled over all answers' words), eval/valid_fraction (by the declared valid
    rule, models.valid, else the gold's "valid" component), eval/judge_score (reward.judge's mean:
    models.judge or models.judge_model, raw scores). With `episodes` each
    prompt is an episode, scored on its final answer, and eval/env/* counts its turns and tool calls
    (the KL and length are over the model's tokens of every turn).
    """
    table, texts, played = _measure_chunks(
        policy, tokenizer, prompts, models, sampling, seed, batch_size, generate_kwargs, episodes
    )
    rm, rm_std, kl_ref, kl_sft, judged, lengths = ([table[:, i]] for i in range(6))
    records = prompts.records
    gold, declared, judge = _gold_scores(models.gold, records, texts, models.valid, models.judge)
    if models.judge_model is not None:
        judge = [float(x) for x in judged[0]]
    n = len(gold.scores)
    mean, stderr = mean_and_stderr(gold.scores)
    # The declared valid rule (reward.valid) where there is one, else the gold's own "valid"
    # component, else a positive gold score counts as valid.
    valid = declared or [float(v) for v in gold.components.get("valid", [s > 0 for s in gold.scores])]
    metrics = {
        "eval/gold_score": mean,
        "eval/gold_score_stderr": stderr,
        "eval/kl": float(torch.cat(kl_ref).mean()),
        "eval/kl_to_sft": float(torch.cat(kl_sft).mean()),
        "eval/response_length": float(torch.cat(lengths).float().mean()),
        "eval/distinct_2": distinct_n([t.split() for t in texts], 2),
        "eval/valid_fraction": sum(valid) / n,
    }
    if judge is not None:
        metrics["eval/judge_score"] = sum(judge) / n
    if models.reward_model is not None:
        metrics["eval/rm_score"] = float(torch.cat(rm).mean())
        if not torch.isnan(torch.cat(rm_std)).all():  # an ensemble reward model: its heads' mean spread
            metrics["eval/rm_score_std_ensemble"] = float(torch.cat(rm_std).mean())
    if episodes is not None:
        metrics |= episode_metrics(played, "eval/env/") | _tool_use_metrics(played, gold.scores)
    metrics.update({f"eval/gold/{k}": sum(v) / n for k, v in gold.components.items()})
    rows = [
        {
            "prompt": records[i].prompt,
            "response": texts[i],
            "gold_score": gold.scores[i],
            "rm_score": None if models.reward_model is None else float(torch.cat(rm)[i]),
        }
        | ({"transcript": played[i]["transcript"]} if episodes is not None else {})
        for i in range(min(n_samples, n))
    ]
    rm_scores = None if models.reward_model is None else tuple(float(x) for x in rm[0])
    judged_scores = None if judge is None else tuple(float(x) for x in judge)
    return PolicyEvaluation(metrics, rows, tuple(float(x) for x in gold.scores), tuple(valid), judged_scores, rm_scores)


def _measure_chunks(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: PromptSet,
    models: ScoringModels,
    sampling: SamplingParams,
    seed: int,
    batch_size: int,
    generate_kwargs: dict[str, Any] | None,
    episodes: EpisodeSampler | None,
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """Sample every prompt's answer in chunks of `batch_size` (each seeded from (seed, its start),
    spread over the ranks) and measure it: ([n_prompts, 6] rm score, its heads' std, KL to the
    reference and to the SFT policy, a judge model's score, length; the answers; with `episodes`,
    each one's summary and transcript), gathered in prompt order on every rank."""
    texts: list[str] = []
    played: list[dict[str, Any]] = []  # with episodes: each row's Trajectory.summary() and transcript
    per_row: list[torch.Tensor] = []  # [b, 6] per chunk: rm score, its heads' std, kl to reference and sft,
    # a judge model's score, length
    for c, real in dist.rank_chunks(len(prompts.token_ids), batch_size):
        start = c * batch_size
        chunk = prompts.token_ids[start : start + batch_size]
        if episodes is not None:
            batch = episodes.sample(policy, prompts.records[start : start + batch_size], sampling, seed + start)
        else:
            batch = generate_rollouts(policy, tokenizer, chunk, sampling, seed + start, **(generate_kwargs or {}))
        rows = len(chunk)
        temperature = sampling.temperature or 1.0  # greedy answers: KL of the untempered distributions
        logprobs = batched_logprobs(policy, batch, temperature, chunk=rows)
        mask = batch.response_mask
        if models.reward_model is None:
            columns = [torch.full((rows,), float("nan"))] * 2
        else:
            heads = normalised_head_scores(models.reward_model, batch, models.score_norm, rows)
            mean, std = ensemble_mean_std(heads)
            columns = [mean, std if heads.shape[1] > 1 else torch.full((rows,), float("nan"))]
        for anchor in (models.reference, models.sft):
            anchor_lp = batched_logprobs(anchor, batch, temperature, chunk=rows)
            columns.append(masked_mean(token_kl(logprobs, anchor_lp, "k3"), mask, dim=1))
        columns.append(_judge_model_scores(models.judge_model, batch, rows))
        if real:
            per_row.append(torch.stack(columns + [mask.sum(1)], 1))
            texts.extend(batch.response_texts)
        if episodes is not None:
            chunk_played = _played(episodes, tokenizer)
            played += chunk_played if real else []
    n_prompts = len(prompts.token_ids)
    table = dist.gather_chunked(torch.cat(per_row), n_prompts, batch_size, 0.0)
    texts = dist.gather_chunked_list(texts, n_prompts, batch_size)
    if episodes is not None:
        played = dist.gather_chunked_list(played, n_prompts, batch_size)
    return table, texts, played


def _judge_model_scores(judge_model: torch.nn.Module | None, batch: Any, rows: int) -> torch.Tensor:
    """[rows] a second reward model's raw score of each answer (its heads' mean); NaN without one."""
    if judge_model is None:
        return torch.full((rows,), float("nan"))
    return head_columns(batched_scores(judge_model, batch, rows)).mean(1)


def _played(episodes: EpisodeSampler, tokenizer: Any) -> list[dict[str, Any]]:
    """The chunk's episodes: counts, and the whole conversation as the model saw it (turn tokens kept)."""
    return [t.summary() | {"transcript": tokenizer.decode(list(t.prompt_ids + t.ids))} for t in episodes.take()]


def _tool_use_metrics(played: list[dict[str, Any]], scores: Sequence[float]) -> dict[str, float]:
    """eval/env/well_formed_call_share: episodes with at least one call that parsed and ran;
    eval/env/no_call_share, and eval/env/gold_without_calls: the gold score of those (when any)."""
    n = len(played)
    without = [s for s, p in zip(scores, played) if p["tool_calls"] == 0]
    metrics = {
        "eval/env/well_formed_call_share": sum(p["tool_calls"] - p["tool_errors"] >= 1 for p in played) / n,
        "eval/env/no_call_share": len(without) / n,
    }
    if without:
        metrics["eval/env/gold_without_calls"] = sum(without) / len(without)
    return metrics


def _gold_scores(
    gold: Any, records: Sequence[PromptRecord], texts: list[str], valid_rule: Any = None, judge_rule: Any = None
) -> tuple[GoldScores, list[float] | None, list[float] | None]:
    """Rank 0 alone calls the gold function (it may be an external judge, slow or not deterministic),
    the declared valid rule and the judge; every rank gets their results, so decisions taken from
    them (keep_best, checkpoints) agree. Returns the gold's scores, the valid rule's and the judge's
    (None: no such rule)."""
    local = None
    if dist.is_main():
        prompts, fields = [r.prompt for r in records], [r.fields for r in records]
        scored = score_answers(gold, prompts, texts, fields)
        rules = {"valid": valid_rule, "judge": judge_rule}
        local = {"scores": scored.scores, "components": scored.components}
        local |= {k: None if f is None else score_answers(f, prompts, texts, fields).scores for k, f in rules.items()}
    shared = dist.all_gather_json(local)[0] if dist.is_distributed() else local
    return GoldScores(shared["scores"], shared["components"]), shared["valid"], shared["judge"]
