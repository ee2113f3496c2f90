"""The online-label stage: the round's policy answers prompts twice and a labeller picks the better
answer; the pairs are the reward model's (or online DPO's) fresh preferences."""

from __future__ import annotations

import json
import random
from typing import Any, Literal

from rlflow.engine.config.base import SectionView
from rlflow.engine.config.sampling import SamplingConfig
from rlflow.engine.config.schema import Config, DataConfig
from rlflow.engine.config.stages import LabelConfig
from rlflow.engine.data.batching import batch_indices
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.data.records import PromptRecord, load_prompts
from rlflow.engine.models.loading import load_policy, load_tokenizer, model_kwargs
from rlflow.engine.rewards.user_functions import load_function
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.seeds import step_seed
from rlflow.engine.stages.context import Record, StageContext, StageOutcome
from rlflow.engine.stages.inputs import ModelInput, ModelLoading, StageInputs
from rlflow.engine.stages.lifecycle import finish

PAIRS_FILE = "pairs.jsonl"
PAIRS_EVAL_FILE = "pairs_eval.jsonl"  # held out of reward-model training (label.eval_fraction)


class PromptData(SectionView, source=DataConfig):
    """The data.* keys of a stage that samples answers to data.prompts."""

    prompts: str
    max_prompt_tokens: int
    prompt_overflow: Literal["truncate", "drop"]
    chat_template: Literal["auto", "none"]
    storage_options: dict[str, Any]


class LabelUpstream(Record):
    policy: ModelInput  # the policy that answers


class LabelInputs(StageInputs):
    """Everything the online-label stage reads."""

    upstream: LabelUpstream
    model: ModelLoading
    data: PromptData
    sampling: SamplingConfig
    label: LabelConfig  # the labeller, prompts per round, the held-out share


def inputs_from(config: Config, upstream: LabelUpstream) -> LabelInputs:
    return LabelInputs(
        seed=config.run.seed,
        upstream=upstream,
        model=ModelLoading.for_stage(config.model, "label"),
        data=PromptData.of(config.data),
        sampling=config.sampling,
        label=config.label,
    )


def sample_answer_pairs(
    policy_path: str, model: ModelLoading, data: PromptData, sampling: SamplingConfig, n_prompts: int, seed: int,
    round_index: int,
) -> list[tuple[PromptRecord, str, str]]:
    """(prompt record, answer A, answer B) for `n_prompts` of data.prompts, each answered twice
    by the policy: what a labeller (a function, or raters after `rlflow label export`) compares.
    The prompts and draws are a function of (seed, round)."""
    tokenizer = load_tokenizer(policy_path, model.trust_remote_code, chat_template=data.chat_template)
    policy = load_policy(policy_path, **model_kwargs(model)).eval()  # model.attn_implementation too
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
                sampling.params(),
                step_seed(seed, round_index, draw, start, 8),
            )
            texts.extend(batch.response_texts)
        answers.append(texts)
    return list(zip(prompts.records, *answers))


def run_label_stage(ctx: StageContext, inputs: LabelInputs) -> StageOutcome:
    """The current policy answers label.prompts_per_round prompts twice; the labeller picks one
    (ties dropped).

    Writes the labelled pairs (prompt, chosen, rejected) in the stage's step 0: `pairs.jsonl` for
    training and, with label.eval_fraction > 0, that share of them as `pairs_eval.jsonl` instead.
    """
    cfg = inputs.label
    labeller = load_function(cfg.labeller.fn, "label.labeller.fn")
    triples = sample_answer_pairs(
        inputs.upstream.policy.uri, inputs.model, inputs.data, inputs.sampling, cfg.prompts_per_round, inputs.seed,
        ctx.round_index,
    )
    rng = random.Random(step_seed(inputs.seed, ctx.round_index, 9))
    rows, ties, empty = [], 0, 0
    for record, a, b in triples:
        if not a.strip() or not b.strip():  # preference data holds non-empty answers only
            empty += 1
            continue
        choice = labeller(record.prompt, a, b, rng=rng, **cfg.labeller.kwargs, **record.fields)
        if choice is None:
            ties += 1
            continue
        chosen, rejected = (a, b) if choice == 0 else (b, a)
        rows.append({"prompt": record.prompt, "chosen": chosen, "rejected": rejected})
    # Its own stream: the labeller's draws (and so the pairs) do not depend on the split.
    split = random.Random(step_seed(inputs.seed, ctx.round_index, 11))
    held = set(split.sample(range(len(rows)), round(len(rows) * cfg.eval_fraction)))
    train = [row for i, row in enumerate(rows) if i not in held]
    held_out = [row for i, row in enumerate(rows) if i in held]
    with ctx.store.writer(0) as writer:
        writer.write_bytes(PAIRS_FILE, _jsonl(train))
        if cfg.eval_fraction > 0:
            writer.write_bytes(PAIRS_EVAL_FILE, _jsonl(held_out))
        writer.meta.update(identity=ctx.identity, identity_tree=ctx.identity_tree)
    metrics = {"label/pairs": float(len(train)), "label/ties_dropped": float(ties), "label/empty_dropped": float(empty)}
    if cfg.eval_fraction > 0:
        metrics["label/pairs_eval"] = float(len(held_out))
    ctx.sink.log_metrics(metrics, 0)
    return finish(ctx, 0, metrics, None)


def _jsonl(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()
