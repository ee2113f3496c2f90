"""One repetition of rlflow's PPO, with the bare-torch floor beside it, for bench/ppo_vs_trl.py.

    python bench/rlflow_ppo_worker.py '<workload JSON>'     # normally started by bench/ppo_vs_trl.py

Loads the four models through rlflow's engine, runs `warmup` PPO steps untimed, then times `updates`
steps one by one (generation + scoring + updates), keeping every step's timing_s/* metric. After each
timed step it times, once each, the floor: the same batch through bare transformers calls (a generate,
a reference forward, a reward-model forward, an actor forward+backward, a critic forward+backward) and
a 2048^3 fp32 torch.mm (this machine's matmul rate, for the MFU). Interleaved, because this VM's speed
drifts by tens of percent over minutes, and a floor measured in another minute compares nothing.
Every interval records how many cores other jobs kept busy; after one they disturbed the worker waits
(at most quiet_s) for the cores to clear. Prints one line `BENCH_JSON {...}` on stdout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from bench_assets import cpu_snapshot, emit_result, foreign_cores, ids_crc, open_rl_run, prompt_ids, wait_quiet


def ppo_tree(work: dict) -> dict:
    """The run configuration: one epoch over one mini-batch of the whole batch, a critic, a fixed KL
    penalty in the reward, whitened advantages."""
    batch = work["batch"]
    return {
        "rl": {"rollout_batch": batch, "mini_batch": batch, "epochs": 1, "actor_lr": work["lr"], "max_grad_norm": 1.0},
        "ppo": {"critic_lr": work["lr"], "whiten_advantages": True},
        "kl": {"controller": "fixed", "coef": work["kl_coef"], "stop_above": None},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": work["max_new_tokens"]},
        "rollout": {"generate_batch": batch},
        "model": {"dtype": "float32"},
        "run": {"seed": work["seed"]},
    }


def setup_rlflow(work: dict) -> tuple[Callable[[int], dict[str, float]], list[list[int]], dict]:
    """rlflow's side: PPO steps opened by the RL-run entry point (bench_assets.open_rl_run). Returns a
    function running PPO step `step` (1-based) and returning its metrics, the prompt ids and the
    resolved config."""
    policy, rm = work["policy"], work["rm"]
    run = open_rl_run(ppo_tree(work), policy, rm, rm, work["prompts"], work["batch"], work["max_prompt_tokens"])
    resolved = {k: getattr(run.inputs, k).model_dump(mode="json") for k in ("rl", "ppo")}
    return run.step, [list(t) for t in run.prompts.token_ids], resolved


class Clock:
    """Times calls, each with the cores other processes kept busy during it."""

    def __init__(self, quiet_s: float):
        self.quiet_s, self.last_foreign = quiet_s, 0.0

    def __call__(self, fn: Callable[[], object]) -> tuple[dict, object]:
        wait_quiet(self.quiet_s, self.last_foreign)
        before = cpu_snapshot()
        out = fn()
        after = cpu_snapshot()
        self.last_foreign = foreign_cores(before, after)
        return {"seconds": after[0] - before[0], "foreign_cores": self.last_foreign}, out


class StepLog:
    """Runs rlflow's steps on a Clock and keeps what the report needs: each warm-up step's seconds, each
    timed step's seconds, foreign cores and timing_s/* phases, and every step's metrics. Stops the worker
    on a response that is not full length: with the EOS unreachable both sides sample max_new_tokens, or
    the comparison is off."""

    def __init__(self, clock: Clock, work: dict):
        self.clock, self.warmup, self.new_tokens = clock, work["warmup"], work["max_new_tokens"]
        self.metrics: list[dict[str, float]] = []
        self.timed: list[dict] = []
        self.warmup_s: list[float] = []

    def run(self, step: Callable[[int], dict[str, float]], index: int) -> dict[str, float]:
        timing, metrics = self.clock(lambda: step(index))
        self.metrics.append(metrics)
        if metrics.get("response_length/mean") != self.new_tokens:
            length = metrics.get("response_length/mean")
            raise SystemExit(f"step {index}: response_length/mean={length}, expected {self.new_tokens}")
        if index <= self.warmup:
            self.warmup_s.append(timing["seconds"])
        else:
            self.timed.append(dict(timing, timings={k: v for k, v in metrics.items() if k.startswith("timing_s/")}))
        return metrics

    def fields(self) -> dict:
        return {
            "side": "rlflow",
            "update_s": [s["seconds"] for s in self.timed],
            "foreign_cores": [s["foreign_cores"] for s in self.timed],
            "timings": [s["timings"] for s in self.timed],
            "warmup_s": self.warmup_s,
            "response_length": [m["response_length/mean"] for m in self.metrics],
            "threads": torch.get_num_threads(),
        }


def floor_passes(work: dict) -> tuple[dict[str, Callable[[], None]], list[list[int]]]:
    """The cheapest this batch's PPO iteration could be with the same models and library: only the
    passes PPO cannot skip, each on the whole batch at once, no bookkeeping between them."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(work["policy"])
    tok.padding_side = "left"
    ids = prompt_ids(tok, work["prompts"], work["batch"], work["max_prompt_tokens"])
    enc = tok.pad({"input_ids": ids}, return_tensors="pt")
    fp32 = {"dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(work["policy"], **fp32)
    reference = AutoModelForCausalLM.from_pretrained(work["policy"], **fp32).eval()
    reward = AutoModelForSequenceClassification.from_pretrained(work["rm"], num_labels=1, **fp32).eval()
    critic = AutoModelForSequenceClassification.from_pretrained(work["rm"], num_labels=1, **fp32)
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=work["max_new_tokens"], use_cache=True
    )
    gen_cfg.pad_token_id, gen_cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    with torch.no_grad():  # not inference_mode: these ids feed the timed backward passes
        seqs = policy.eval().generate(**enc, generation_config=gen_cfg)
    width = enc["input_ids"].shape[1]
    if seqs.shape[1] - width != work["max_new_tokens"]:
        raise SystemExit(f"floor: generate returned {seqs.shape[1] - width} new tokens")
    mask = torch.cat([enc["attention_mask"], torch.ones_like(seqs[:, width:])], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    policy.train(), critic.train()

    def generate():
        with torch.inference_mode():
            policy.generate(**enc, generation_config=gen_cfg)

    def values(model):
        hidden = model.model(input_ids=seqs, attention_mask=mask, position_ids=positions).last_hidden_state
        return model.score(hidden).squeeze(-1)

    def reference_forward():
        with torch.inference_mode():
            reference(input_ids=seqs, attention_mask=mask, position_ids=positions, use_cache=False)

    def reward_forward():
        with torch.inference_mode():
            values(reward)

    def actor_fwd_bwd():
        logits = policy(input_ids=seqs, attention_mask=mask, position_ids=positions, use_cache=False).logits
        logp = torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(-1, seqs[:, width:, None])
        (-logp.mean()).backward()
        policy.zero_grad(set_to_none=True)

    def critic_fwd_bwd():
        (values(critic)[:, width - 1 : -1] ** 2).mean().backward()  # MSE against 0 returns
        critic.zero_grad(set_to_none=True)

    passes = [generate, reference_forward, reward_forward, actor_fwd_bwd, critic_fwd_bwd]
    return {fn.__name__: fn for fn in passes}, ids


MATMUL_N = 2048


def main() -> None:
    work = json.loads(sys.argv[1])
    torch.set_num_threads(work["threads"])
    torch.manual_seed(work["seed"])
    step, ids, config = setup_rlflow(work)
    passes, floor_ids = floor_passes(work)
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    passes["matmul"] = lambda: torch.mm(a, b)
    clock = Clock(work["quiet_s"])
    log = StepLog(clock, work)
    floor: dict[str, list[dict]] = {name: [] for name in passes}
    for index in range(1, work["warmup"] + work["updates"] + 1):
        log.run(step, index)
        for name, fn in passes.items():  # the warm-up round pays first-call costs, untimed
            runs = clock(fn)[0]
            if index > work["warmup"]:
                floor[name].append(runs)
    floor_parts = {k: v for k, v in floor.items() if k != "matmul"}
    result = log.fields() | {
        "floor": {"parts": floor_parts, "matmul_runs": floor["matmul"]},
        "matmul_flop": 2 * MATMUL_N**3,
        "floor_prompt_ids_crc32": ids_crc(floor_ids),
        "config": config,
    }
    emit_result(work, ids, result)


if __name__ == "__main__":
    main()
