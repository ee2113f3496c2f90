"""Two SFT steps, two reward-model steps and one PPO step on a given backend; rank 0 writes the
losses (JSON) and the updated weights (safetensors) so a test can compare backends.

usage: backend_parity.py OUT_DIR SFT_DIR RM_DIR SCORE_MEAN SCORE_STD ASSETS_DIR BACKEND [ZERO_STAGE ...]
BACKEND "torch" runs in this one process; "deepspeed" under torchrun with any number of ranks.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import OptimSpec
from rlflow.engine.backend.factory import make_runtime
from rlflow.engine.data.batching import batch_indices, encode_pair
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.data.records import load_preference_pairs, load_prompts, load_sft_examples
from rlflow.engine.stages.evaluation import encode_prompt_set
from rlflow.engine.models.loading import load_policy, load_scalar_model, load_tokenizer
from rlflow.engine.stages.rl.experience import Objective, make_experience
from rlflow.engine.stages.rl.step import make_controller, ppo_step
from rlflow.engine.stages.rl.stage import PPOInputs, load_ppo_models
from rlflow.engine.stages.reward_model import _pair_rows, rm_train_step
from rlflow.engine.stages.sft import sft_train_step
from rlflow.engine.stages.context import StageContext
from rlflow.engine.seeds import step_seed


def zero_gold(prompt, response, **fields):
    return 0.0


def run(out: Path, sft_dir: str, rm_dir: str, norm, assets: Path, engine_cfg: EngineConfig) -> None:
    torch.manual_seed(0)
    runtime = make_runtime(engine_cfg)
    ctx = StageContext(store=None, stage="x", round_index=0, seed=0, identity="x", identity_tree={})  # type: ignore[arg-type]
    tokenizer = load_tokenizer(sft_dir)
    pad = tokenizer.pad_token_id
    result, weights = {}, {}

    sft_rows = [encode_pair(tokenizer, e.prompt, e.response, 64) for e in load_sft_examples(f"{assets}/data/sft.jsonl")]
    sft = runtime.trainable("model", lambda: load_policy(sft_dir), OptimSpec(1e-3, 0.01, 1, 10, 1.0))
    result["sft"] = [sft_train_step(sft, runtime, sft_rows, pad, 16, step, ctx) for step in (1, 2)]
    weights.update({f"sft.{k}": v for k, v in (sft.gathered_state_dict() or {}).items()})

    pairs = load_preference_pairs(f"{assets}/data/preferences.jsonl")
    rm_rows = _pair_rows(tokenizer, list(pairs), 64)

    def load_rm():
        model = load_scalar_model(rm_dir)
        model.config.pad_token_id = pad
        return model

    rm = runtime.trainable("model", load_rm, OptimSpec(1e-3, 0.0, 0, 10, 1.0))
    ones = torch.ones(len(rm_rows), 1)  # one head: every pair once
    result["rm"] = [rm_train_step(rm, runtime, rm_rows, ones, pad, 16, step, ctx) for step in (1, 2)]
    weights.update({f"rm.{k}": v for k, v in (rm.gathered_state_dict() or {}).items()})

    tree = {"ppo": {"rollout_batch": 16, "mini_batch": 8, "epochs": 1}, "sampling": {"max_new_tokens": 16}}
    cfg = build_config(tree, "parity")
    models = load_ppo_models(
        PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir), cfg.model, cfg.ppo, zero_gold, runtime
    )
    records = load_prompts(f"{assets}/data/prompts.jsonl")
    prompts, _, _ = encode_prompt_set(models.tokenizer, records, 32, "truncate", "prompts")
    # The rollout ppo_step is about to draw (same seeds): chunk 0 is sampled by rank 0, chunk 1 by
    # rank 1 (under ZeRO-3 with synced_gpus); record each chunk's longest response.
    index = batch_indices(len(prompts.token_ids), 16, 1, 0, 0, 3)
    objective = Objective.of(cfg)
    rows = [prompts.token_ids[i] for i in index]
    exp = make_experience(models, cfg.ppo, rows, 0.05, step_seed(0, 0, 1, 4), 8, objective=objective)
    chunk_lengths = [int(exp.batch.response_mask[c * 8 : (c + 1) * 8].sum(1).max()) for c in (0, 1)]
    metrics = ppo_step(models, make_controller(cfg.kl), cfg.ppo, prompts, 0, 0, 1, 8, objective)
    result["ppo"] = {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}
    weights.update({f"actor.{k}": v for k, v in (models.actor.gathered_state_dict() or {}).items()})
    weights.update({f"critic.{k}": v for k, v in (models.critic.gathered_state_dict() or {}).items()})
    # GRPO: critic-free, 2 samples per prompt, the KL as a loss term, per-sequence loss averaging;
    # mini-batches of 4 prompts x 2 samples, split over the ranks and cut by the token budget.
    tree = {
        "ppo": {
            "rollout_batch": 8,
            "mini_batch": 4,
            "epochs": 1,
            "loss_agg": "seq-mean-token-mean",
        },
        "sampling": {"max_new_tokens": 16},
        "kl": {"loss_coef": 0.1},
        "algorithm": {"name": "grpo"},
        "rollout": {"n": 2, "generate_batch": 8},
        "reward": {"sources": [{"name": "rm", "type": "model"}]},
    }
    grpo_cfg = build_config(tree, "parity-grpo")
    models = load_ppo_models(
        PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, None), grpo_cfg.model, grpo_cfg.ppo, zero_gold, runtime
    )
    objective = Objective.of(grpo_cfg)
    metrics = ppo_step(models, make_controller(grpo_cfg.kl), grpo_cfg.ppo, prompts, 0, 0, 1, 8, objective)
    result["grpo"] = {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}
    weights.update({f"grpo.{k}": v for k, v in (models.actor.gathered_state_dict() or {}).items()})
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))
        (out / "chunk_lengths.json").write_text(json.dumps(chunk_lengths))
        save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(out / "weights.safetensors"))


def main() -> None:
    out, sft_dir, rm_dir, mean, std, assets, backend, *stages = sys.argv[1:]
    torch.set_num_threads(1)
    norm = (float(mean), float(std))
    if backend == "torch":
        run(Path(out) / "torch", sft_dir, rm_dir, norm, Path(assets), EngineConfig())
        return
    for stage in stages:
        # Token-budget micro-batches: ranks cut their rows differently (and into different counts).
        cfg = EngineConfig(backend="deepspeed", zero_stage=int(stage), max_tokens_per_microbatch=160)
        run(Path(out) / f"zero{stage}", sft_dir, rm_dir, norm, Path(assets), cfg)


if __name__ == "__main__":
    main()
