"""The shipped model's greedy accuracy on candidate reasoning-gym tasks: how the real demo's task
was chosen (docs/real-model.md). One process, one candidate after another, 2 torch threads.

    .venv/bin/python bench/gym_survey.py --model models/smollm2-135m-instruct [--n 256] [--out FILE]

Each candidate: `rlflow data gym`'s held-out prompts (seed 0 + 10**6, deduplicated against a
training set of 512), the prompt's answer-format sentence, greedy decoding of up to
--max-new-tokens through the chat template, graded by engine/tasksets/gym.py gym_gold (accuracy:
score_answer == 1.0; lenient: the last number; mean score: reasoning-gym's partial credit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

CANDIDATES = [
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "last_number"),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "answer_tag"),
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, "last_number"),
    ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}, "last_number"),
    ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 3}, "last_number"),
    ("simple_equations", {}, "last_number"),
    ("gsm_symbolic", {}, "last_number"),
]


def survey_one(model, tokenizer, name, config, extract, n, max_new_tokens, batch) -> dict:
    from rlflow.engine.data.records import format_prompt, load_prompts
    from rlflow.engine.tasksets.gym import gym_gold, write_gym_dataset
    from rlflow.engine.config.sampling import SamplingParams
    from rlflow.engine.rollout.generate import generate_rollouts

    with tempfile.TemporaryDirectory() as tmp:
        written = write_gym_dataset(name, tmp, 512, n, 0, config, extract)
        records = load_prompts(written["paths"]["eval_prompts"])
    start = time.monotonic()
    grades, lengths, samples = [], [], []
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        ids = [tokenizer(format_prompt(tokenizer, r.prompt), add_special_tokens=False)["input_ids"] for r in chunk]
        out = generate_rollouts(model, tokenizer, ids, SamplingParams(0.0, 1.0, max_new_tokens), seed=0)
        lengths += out.response_mask.sum(1).tolist()
        for record, text in zip(chunk, out.response_texts):
            grades.append(gym_gold(record.prompt, text, extract=extract, **record.fields))
            if len(samples) < 3:
                samples.append({"prompt": record.prompt, "response": text, "answer": record.fields["answer"]})
    mean = lambda key: statistics.fmean(g[key] for g in grades)  # noqa: E731
    accuracy = mean("score")
    return {
        "dataset": name,
        "config": config,
        "extract": extract,
        "n": len(grades),
        "accuracy": round(accuracy, 4),
        "accuracy_stderr": round((accuracy * (1 - accuracy) / len(grades)) ** 0.5, 4),
        "lenient": round(mean("lenient"), 4),
        "mean_score": round(mean("mean_score"), 4),
        "valid": round(mean("valid"), 4),
        "response_tokens": round(statistics.fmean(lengths), 1),
        "seconds": round(time.monotonic() - start, 1),
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--only", type=int, nargs="*", help="candidate indices to run")
    parser.add_argument("--out", help="JSON lines, one per candidate")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.models.loading import load_policy, load_tokenizer

    tokenizer, model = load_tokenizer(args.model), load_policy(args.model).eval()
    for index, (name, config, extract) in enumerate(CANDIDATES):
        if args.only and index not in args.only:
            continue
        try:
            row = survey_one(model, tokenizer, name, config, extract, args.n, args.max_new_tokens, args.batch)
        except ConfigError as exc:  # e.g. too few distinct questions at this difficulty
            row = {"dataset": name, "config": config, "extract": extract, "error": str(exc)}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
