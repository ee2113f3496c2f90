"""Where sampling time goes at SmolLM2-135M on this CPU: one decode step against the memory-bandwidth floor.

    .venv/bin/python bench/decode_floor.py [--batch 8] [--new 32] [--reps 3] [--compile]

On the bench's SmolLM2 assets (bench_assets.py: EOS unreachable, so every row decodes exactly --new
tokens; the demo prompts, as written), fp32, 2 threads, each figure the median of --reps runs:
  bandwidth     a 256 MiB tensor copy; bytes moved (read + write) per second
  floor         weight bytes / bandwidth: one decode step must read every weight once
  bare_forward  one cached forward of the batch (DynamicCache), no sampling: the per-step cost of the
                library, mostly 30 layers x (norm, attention, MLP) kernel launches at batch 8
  rlflow        engine.rollout.generate_rollouts (engine/rollout/decode.py's own layer loop, sampling; its
                per-call weight reorder counted), per decode step after prefill
  hf_static     HF generate with cache_implementation="static"
  manual_loop   a plain Python loop over cached forwards with the same sampling
  compiled      (--compile) the same loop over a StaticCache, its one-token step torch.compile'd once
                (dynamic=False: one graph per batch and prompt width); the compile's seconds are
                reported apart (compile_s), the per-step figure is after it
Greedy tokens of every variant are compared with HF generate's (`identical`). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_assets import build as build_assets
from bench_assets import prompt_ids


def timed(fn, reps: int) -> float:
    fn()  # warm-up: allocator, first-call paths
    runs = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def copy_bandwidth(reps: int) -> float:
    src = torch.ones(64 * 2**20)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), reps)


def manual_decode(model, ids, attention, new: int, greedy: bool) -> torch.Tensor:
    """Prefill then `new` - 1 cached single-token forwards, sampling at temperature 1 (or argmax)."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache).logits
    for step in range(new):
        last = logits[:, -1].float()
        token = last.argmax(-1) if greedy else torch.multinomial(last.softmax(-1), 1).squeeze(1)
        out.append(token)
        if step == new - 1:
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
        positions = positions[:, -1:] + 1
        logits = model(
            input_ids=token[:, None], attention_mask=attention, position_ids=positions, past_key_values=cache
        ).logits
    return torch.stack(out, 1)


def static_decoder(model, batch: int, max_len: int):
    """manual_decode over a StaticCache with the one-token step compiled (fixed shapes)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)

    def one(token, cache_position, attention, positions):
        out = model(
            input_ids=token, attention_mask=attention, position_ids=positions, past_key_values=cache,
            cache_position=cache_position,
        )
        return out.logits[:, -1]

    compiled = torch.compile(one, dynamic=False)

    def run(ids, attention, new: int, greedy: bool) -> torch.Tensor:
        cache.reset()
        width = ids.shape[1]
        full = torch.cat([attention, torch.zeros(batch, max_len - width, dtype=attention.dtype)], 1)
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        logits = one(ids, torch.arange(width), full[:, :width], positions)  # prefill, eager
        positions, out = positions[:, -1:], []
        for step in range(new):
            last = logits.float()
            token = last.argmax(-1) if greedy else torch.multinomial(last.softmax(-1), 1).squeeze(1)
            out.append(token)
            if step == new - 1:
                break
            full[:, width + step] = 1
            positions = positions + 1
            logits = compiled(token[:, None], torch.tensor([width + step]), full, positions)
        return torch.stack(out, 1)

    return run


def bare_forward_step(model, ids: torch.Tensor, attention: torch.Tensor, reps: int) -> float:
    """Seconds of one cached single-token forward after the prompt (the cache cropped back each time)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=ids, attention_mask=attention, past_key_values=cache)
    one = torch.full((ids.shape[0], 1), 5)
    mask = torch.cat([attention, torch.ones_like(one)], 1)

    def bare():
        extra = cache.get_seq_length() - ids.shape[1]
        if extra:  # the same cache length every time
            cache.crop(-extra)
        model(input_ids=one, attention_mask=mask, past_key_values=cache)

    return timed(bare, reps)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also a compiled static-cache decode step")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rlflow.engine.models.loading import load_tokenizer
    from rlflow.engine.data.batching import left_pad
    from rlflow.engine.config.sampling import SamplingParams
    from rlflow.engine.rollout.generate import generate_rollouts

    os.chdir(Path(__file__).resolve().parents[1])  # the assets' paths are relative to the repository
    assets = build_assets()
    path = assets["smollm2"]["policy"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path, chat_template="none")
    prompts = prompt_ids(tokenizer, assets["prompts"], args.batch, 32)
    ids, attention = left_pad(prompts, tokenizer.pad_token_id)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(args.reps)
    new, steps = args.new, args.new - 1  # the first token comes from the prefill

    def hf(greedy: bool, **extra):
        config = GenerationConfig(
            do_sample=not greedy, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=new, min_new_tokens=new,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **extra,
        )
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=attention, generation_config=config)[:, ids.shape[1]:]

    with torch.no_grad():
        prefill = timed(lambda: model(input_ids=ids, attention_mask=attention), args.reps)
        bare_step = bare_forward_step(model, ids, attention, args.reps * 5)
        reference = hf(greedy=True)
        variants = {
            "rlflow": (
                lambda: generate_rollouts(model, tokenizer, prompts, SamplingParams(1.0, 1.0, new), 0),
                generate_rollouts(model, tokenizer, prompts, SamplingParams(0.0, 1.0, new), 0).response_ids,
            ),
            "hf_dynamic": (lambda: hf(False), reference),
            "hf_static": (lambda: hf(False, cache_implementation="static"), hf(True, cache_implementation="static")),
            "manual_loop": (
                lambda: manual_decode(model, ids, attention, new, False),
                manual_decode(model, ids, attention, new, True),
            ),
        }
        compile_s = None
        if args.compile:
            step_fn = static_decoder(model, args.batch, ids.shape[1] + new)
            started = time.perf_counter()
            compiled_greedy = step_fn(ids, attention, new, True)  # the first call compiles
            compile_s = time.perf_counter() - started
            variants["compiled"] = (lambda: step_fn(ids, attention, new, False), compiled_greedy)
        per_step = {}
        for name, (fn, greedy_tokens) in variants.items():
            seconds = timed(fn, args.reps)
            per_step[name] = {
                "seconds": seconds,
                "decode_step_s": (seconds - prefill) / steps,
                "identical": None if greedy_tokens is None else bool(torch.equal(greedy_tokens, reference)),
            }
    floor = weight_bytes / bandwidth
    row = {
        "batch": args.batch,
        "new_tokens": new,
        "prompt_width": ids.shape[1],
        "weight_bytes": weight_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_decode_step_s": floor,
        "prefill_s": prefill,
        "bare_forward_step_s": bare_step,
        "compile_s": compile_s,
        "variants": per_step,
        "rlflow_tokens_per_s": args.batch * new / per_step["rlflow"]["seconds"],
        "rlflow_step_over_floor": per_step["rlflow"]["decode_step_s"] / floor,
        "rlflow_step_over_bare_forward": per_step["rlflow"]["decode_step_s"] / bare_step,
    }
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
