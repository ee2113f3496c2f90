"""Two SFT steps, two reward-model steps, one PPO step and one GRPO step (opened by the RL-run entry
point) on a given backend; rank 0 writes the losses (JSON) and the updated weights (safetensors) so a
test can compare backends.

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
from rlflow.engine.data.batching import encode_pair
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.data.records import load_preference_pairs, load_sft_examples
from rlflow.engine.models.loading import load_policy, load_scalar_model, load_tokenizer
from rlflow.engine.stages.catalog import stage_inputs
from rlflow.engine.stages.inputs import ModelInput, RewardModelInput
from rlflow.engine.stages.rl.experience import sample_and_score
from rlflow.engine.stages.rl.inputs import RLUpstream
from rlflow.engine.stages.rl.run import RLRun
from rlflow.engine.stages.rl.step import step_draw
from rlflow.engine.stages.reward_model import _pair_rows, rm_train_step
from rlflow.engine.stages.sft import sft_train_step
from rlflow.engine.stages.context import StageContext


def open_rl(tree: dict, sft_dir: str, rm_dir: str, norm, assets: Path, runtime, critic: bool) -> RLRun:
    """The RL steps of `tree` from the SFT policy, the reward model's scores normalised by `norm`."""
    data = {"prompts": f"{assets}/data/prompts.jsonl", "eval_prompts": f"{assets}/data/eval_prompts.jsonl",
            "max_prompt_tokens": 32}
    cfg = build_config(tree | {"data": data}, "parity")
    sft = ModelInput(uri=sft_dir, identity="parity")
    upstream = RLUpstream(policy=sft, reference=sft, sft=sft,
                          reward_model=RewardModelInput(uri=rm_dir, identity="parity", score_norm=norm),
                          critic=ModelInput(uri=rm_dir, identity="parity") if critic else None)
    return RLRun.open(runtime, stage_inputs(cfg, "rl", upstream))


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

    tree = {"rl": {"rollout_batch": 16, "mini_batch": 8, "epochs": 1}, "sampling": {"max_new_tokens": 16},
            "rollout": {"generate_batch": 8}}
    with open_rl(tree, sft_dir, rm_dir, norm, assets, runtime, critic=True) as rl_run:
        # The rollout the step is about to draw (same seeds): chunk 0 is sampled by rank 0, chunk 1 by
        # rank 1 (under ZeRO-3 with synced_gpus); record each chunk's longest response.
        draw = step_draw(rl_run.prompts, 16, 1, step=1, seed=0, round_index=0)
        drawn = sample_and_score(rl_run.models, rl_run.objective.sampling, draw.rows, draw.seed, 8, 1, draw.records)
        chunk_lengths = [int(drawn.batch.response_mask[c * 8 : (c + 1) * 8].sum(1).max()) for c in (0, 1)]
        metrics = rl_run.step(1)
        models = rl_run.models
    result["ppo"] = {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}
    weights.update({f"actor.{k}": v for k, v in (models.actor.gathered_state_dict() or {}).items()})
    weights.update({f"critic.{k}": v for k, v in (models.critic.gathered_state_dict() or {}).items()})
    # GRPO: critic-free, 2 samples per prompt, the KL as a loss term, per-sequence loss averaging;
    # mini-batches of 4 prompts x 2 samples, split over the ranks and cut by the token budget.
    tree = {
        "rl": {
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
    with open_rl(tree, sft_dir, rm_dir, norm, assets, runtime, critic=False) as rl_run:
        metrics = rl_run.step(1)
        models = rl_run.models
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
