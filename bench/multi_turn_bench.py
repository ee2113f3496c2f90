"""Multi-turn episodes against single-turn decoding of as many tokens, side by side in one process.

    python bench/multi_turn_bench.py [--model DIR] [--rows 8] [--turns 4] [--turn-tokens 16] [--reps 3]

Each rep runs `run_episodes` on `rows` episodes whose environment calls the real calculator after
every model turn (its result comes back as a tool message) until `turns` turns, then `decode` on the
same prompts for as many steps as the longest episode took, with no stop token, so both sides feed
the same number of token positions through the same model. Tokens/s counts every real id after the
prompt (the model's and the observations'; both pass through the forward one per step). Prints the
median of each side and their ratio, writes bench/results/multi_turn-<UTC time>.json, and last
    RESULT multi_turn_vs_single_turn_tokens_s=<ratio> (issue 19's goal: >= 0.5)
--model: a HF model directory with a chat template (e.g. models/smollm2-135m-instruct); default: the
demo-size tiny Llama with the demo's byte-level chat tokenizer, built here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.data.batching import left_pad
from rlflow.engine.envs.base import EnvStep
from rlflow.engine.envs.chat import ConversationEncoder
from rlflow.engine.envs.tools import CALCULATOR, ToolCall, call_tool
from rlflow.engine.rollout.decode import decode
from rlflow.engine.rollout.episodes import EpisodeLimits, run_episodes

RESULTS = Path(__file__).resolve().parent / "results"


class CalculatorEveryTurn:
    """Whatever the model wrote, calls the calculator and answers with its result, for `turns` turns."""

    def __init__(self, turns: int, seed: int):
        self.turns, self.seed, self.taken = turns, seed, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message):
        self.taken += 1
        if self.taken >= self.turns:
            return EnvStep(done=True)
        text, _ = call_tool({"calculator": CALCULATOR}, ToolCall("calculator", {"expression": f"{self.seed} * 7919"}))
        return EnvStep(observation=[{"role": "tool", "content": text}], info={"tool_calls": 1.0})


def load(model_dir: str | None):
    if model_dir is None:
        from rlflow.engine.tasksets.demo import make_chat_tokenizer, make_tiny_model

        tokenizer = make_chat_tokenizer(["what is 1234 times 5678", "the answer is", "tool result 9771946"])
        return tokenizer, make_tiny_model(tokenizer, seed=0).eval()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()


def one_rep(tokenizer, model, rows: int, turns: int, turn_tokens: int, seed: int) -> dict:
    encoder = ConversationEncoder(tokenizer, [CALCULATOR.schema()])
    first = [[{"role": "user", "content": f"What is {1000 + 37 * i} times 7919?"}] for i in range(rows)]
    envs = [CalculatorEveryTurn(turns, 1000 + 37 * i) for i in range(rows)]
    limits = EpisodeLimits(max_turns=turns, max_new_tokens=turn_tokens, max_total_tokens=turns * (turn_tokens + 64))
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=turn_tokens)
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with ThreadPoolExecutor(4) as pool:
        start = time.perf_counter()
        trajectories, _ = run_episodes(model, tokenizer, envs, first, encoder, params, limits, stops, seed, pool)
        multi_s = time.perf_counter() - start
    multi_tokens = sum(len(t.ids) for t in trajectories)
    steps = max(len(t.ids) for t in trajectories)
    ids, attention = left_pad([encoder.prompt_ids(m) for m in first], tokenizer.pad_token_id)
    start = time.perf_counter()
    decode(model, ids, attention, 1.0, 1.0, steps, [], tokenizer.pad_token_id, seed)
    single_s = time.perf_counter() - start
    return {
        "multi_turn_tokens": multi_tokens, "multi_turn_s": multi_s, "multi_turn_tokens_s": multi_tokens / multi_s,
        "single_turn_tokens": rows * steps, "single_turn_s": single_s, "single_turn_tokens_s": rows * steps / single_s,
        "turns": [t.turns for t in trajectories], "generated": sum(sum(t.generated) for t in trajectories),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer, model = load(args.model)
    reps = [one_rep(tokenizer, model, args.rows, args.turns, args.turn_tokens, seed) for seed in range(args.reps + 1)]
    reps = reps[1:]  # the first is a warm-up
    multi = statistics.median(r["multi_turn_tokens_s"] for r in reps)
    single = statistics.median(r["single_turn_tokens_s"] for r in reps)
    for r in reps:
        print(f"multi-turn {r['multi_turn_tokens']} tokens ({r['generated']} sampled) in {r['multi_turn_s']:.2f} s, "
              f"turns {r['turns']}; single-turn {r['single_turn_tokens']} tokens in {r['single_turn_s']:.2f} s")
    print(f"median tokens/s: multi-turn {multi:.1f}, single-turn {single:.1f}")
    RESULTS.mkdir(exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"multi_turn-{stamp}.json"
    out.write_text(json.dumps({"args": vars(args), "reps": reps, "ratio": multi / single}, indent=1))
    print(f"wrote {out}")
    print(f"RESULT multi_turn_vs_single_turn_tokens_s={multi / single:.3f}")


if __name__ == "__main__":
    main()
