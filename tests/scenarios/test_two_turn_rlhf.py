"""Multi-turn RLHF on a tiny Llama with the demo's chat tokenizer: a two-turn dataset through one
step each of SFT, the reward model and GRPO, and online labels of two continuations of one history.

Every stage must see the conversation as the chat template renders it: SFT learns both assistant
turns (the one in the history too; the user's turn between them is not learned), the reward model
scores the last assistant turn after its history, and GRPO samples the next assistant turn of a
conversation whose earlier turns come from the data (only the sampled tokens carry loss)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import RecordingSink, rl_inputs
from helpers.chat_model import write_chat_model
from helpers.stage_ctx import inputs, make_ctx, model, run
from rlflow.engine.config.schema import build_config
from rlflow.engine.data.batching import encode_pair, right_pad
from rlflow.engine.data.records import load_preference_pairs, load_prompts, load_sft_examples
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.stages.label import PAIRS_FILE, LabelUpstream
from rlflow.engine.stages.reward_model import RewardModelUpstream
from rlflow.engine.stages.sft import SFTUpstream, encode_sft_example


def turn(role, content):
    return {"role": role, "content": content}


def history(a, b, c):
    """Two user turns with the first answer between them: the model answers the second."""
    return [turn("user", f"what is {a} plus {b}"), turn("assistant", f"the answer is {a + b}"),
            turn("user", f"and plus {c}")]


def answer(text):
    return [turn("assistant", text)]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-turn")
    problems = [(a, 30, c) for a, c in ((12, 5), (7, 8), (21, 3), (4, 40))]
    prompts = [{"prompt": history(*p), "answer": sum(p)} for p in problems]
    write_chat_model(root, prompts)
    sft = [{"messages": history(*p) + answer(f"the answer is {sum(p)}")} for p in problems]
    prefs = [{"chosen": history(*p) + answer(f"result {sum(p)}"), "rejected": history(*p) + answer("result 17")}
             for p in problems]  # the implicit-prompt form: two whole conversations
    for name, rows in (("sft", sft), ("preferences", prefs)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def config(root, tmp_path, **sections):
    data = {name: str(root / f"{name}.jsonl") for name in ("sft", "preferences", "prompts", "eval_prompts")}
    data |= {"sft_eval": data["sft"], "preferences_eval": data["preferences"]}  # held-out sets: the same rows
    tree = {
        "run": {"name": "t", "root": str(tmp_path), "rounds": 1},
        "model": {"path": str(root / "model")},
        "data": data | {"chat_template": "auto", "max_prompt_tokens": 96},
        "sft": {"max_steps": 1, "batch_size": 4, "lr": 1e-3, "eval_every": 1, "log_every": 1},
        "rm": {"epochs": 1, "batch_size": 4, "lr": 1e-3, "log_every": 1, "norm_samples": 4},
        "algorithm": {"name": "grpo"},
        "rollout": {"n": 2},
        "rl": {"steps": 1, "rollout_batch": 4, "mini_batch": 4, "epochs": 1, "actor_lr": 1e-3},
        "kl": {"stop_above": None},
        "sampling": {"max_new_tokens": 6},
        "eval": {"every_steps": 100, "num_prompts": 4, "batch_size": 4, "num_logged_samples": 4},
        "checkpoint": {"every_steps": 1, "keep_last": 1},
    }
    for name, values in sections.items():
        tree[name] = tree.get(name, {}) | values
    return build_config(tree, "t")


def rendered_ids(tokenizer, messages, generation_prompt):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def moved(before_dir, after_dir):
    start, end = load_file(f"{before_dir}/model.safetensors"), load_file(f"{after_dir}/model.safetensors")
    return max(float((end[k] - start[k]).abs().max()) for k in start if k in end)


def test_a_two_turn_dataset_through_sft_the_reward_model_and_grpo(chat_data, tmp_path):
    cfg = config(chat_data, tmp_path)
    tokenizer = load_tokenizer(cfg.model.path, chat_template="auto")
    conversation = history(12, 30, 5) + answer("the answer is 47")

    # SFT: the loss covers both assistant turns and their ends of turn, not the user's turns.
    example = load_sft_examples(cfg.data.sft)[0]
    row = encode_sft_example(tokenizer, example, cfg.sft, {})
    assert row.prompt == rendered_ids(tokenizer, conversation[:1], True)
    ids = row.prompt + row.response
    assert ids == rendered_ids(tokenizer, conversation, False)[: len(ids)]
    _, _, loss_mask = right_pad([row], tokenizer.pad_token_id)
    learned = tokenizer.decode(torch.tensor(ids)[loss_mask[0].bool()])
    assert learned == "the answer is 42<|im_end|>the answer is 47<|im_end|>"
    sink = RecordingSink()
    sft = run(make_ctx(tmp_path, "sft", sink=sink), inputs(cfg, "sft", SFTUpstream(init=model(cfg.model.path))))
    sft_dir = f"{sft.checkpoint_uri}/model"
    assert len(sink.series("sft/loss")) == 1 and 0 < moved(cfg.model.path, sft_dir) < 1
    tokens = [encode_sft_example(tokenizer, ex, cfg.sft, {}).learned for ex in load_sft_examples(cfg.data.sft)]
    assert sink.series("sft/tokens")[0][1] == sum(sum(t) for t in tokens)  # the batch is the 4 rows

    # The reward model: each pair is scored as the whole conversation, history first.
    pair = load_preference_pairs(cfg.data.preferences)[0]
    assert pair.prompt == tuple(history(12, 30, 5)) and (pair.chosen, pair.rejected) == ("result 47", "result 17")
    chosen = encode_pair(tokenizer, pair.prompt, pair.chosen, 256)
    assert chosen.prompt + chosen.response == rendered_ids(tokenizer, list(pair.prompt) + answer("result 47"), False)[
        : len(chosen.prompt + chosen.response)
    ]
    rm = run(make_ctx(tmp_path, "rm"), inputs(cfg, "rm", RewardModelUpstream(init=model(sft_dir))))
    assert rm.metrics["rm/pairs"] == 4 and rm.metrics["rm/score_std"] > 0
    rm_dir = f"{rm.checkpoint_uri}/model"

    # GRPO: the prompt ids are the template's rendering of the history; only sampled tokens are trained.
    records = load_prompts(cfg.data.prompts)
    prompts, _, _ = encode_prompt_set(tokenizer, records, 96, "truncate", cfg.data.prompts)
    assert list(prompts.token_ids[0]) == rendered_ids(tokenizer, history(12, 30, 5), True)
    batch = generate_rollouts(load_policy(sft_dir), tokenizer, prompts.token_ids, cfg.sampling.params(), seed=0)
    width = batch.prompt_width
    assert batch.response_mask.shape == (4, batch.input_ids.shape[1] - width)  # no loss position before the turn
    for i, ids in enumerate(prompts.token_ids):
        assert batch.input_ids[i, width - len(ids) : width].tolist() == list(ids)
    sink = RecordingSink()
    norm = (rm.metrics["rm/score_mean"], rm.metrics["rm/score_std"])
    outcome = run(make_ctx(tmp_path, "rl", sink=sink), rl_inputs(cfg, sft_dir, rm_dir, norm))
    assert outcome.metrics["rl/steps"] == 1 and 0 < moved(sft_dir, f"{outcome.checkpoint_uri}/model") < 1
    assert all(torch.isfinite(torch.tensor(v)) for _, v in sink.series("actor/pg_loss"))
    samples = sink.tables["eval_samples.json"]
    assert [s["prompt"] for s in samples] == [r.prompt for r in records]  # the history, as the data gave it


def test_online_labels_compare_two_continuations_of_the_same_history(chat_data, tmp_path):
    log = tmp_path / "labelled.jsonl"
    labeller = {"fn": "helpers.reward_fns:longer_noting_rows", "kwargs": {"log": str(log)}}
    cfg = config(chat_data, tmp_path, label={"labeller": labeller, "prompts_per_round": 4})
    outcome = run(make_ctx(tmp_path, "label"), inputs(cfg, "label", LabelUpstream(policy=model(cfg.model.path))))
    seen = [(row["prompt"], row["answer"]) for row in map(json.loads, log.read_text().splitlines())]
    key = json.dumps  # turns are dicts: compare conversations by their JSON
    histories = {key(history(a, 30, c)): a + 30 + c for a, c in ((12, 5), (7, 8), (21, 3), (4, 40))}
    assert sorted(key(list(prompt)) for prompt, _ in seen) == sorted(histories)  # each history, once
    assert all(histories[key(list(prompt))] == gold for prompt, gold in seen)  # with its row's fields
    pairs = load_preference_pairs(f"{outcome.checkpoint_uri}/{PAIRS_FILE}")
    assert len(pairs) == outcome.metrics["label/pairs"] >= 3
    assert all(key(list(p.prompt)) in histories and p.chosen != p.rejected for p in pairs)
