"""The synthetic demo task: data, a BPE tokenizer and a tiny Llama-style model, and the gold rule.

The task: answer "describe the river ." with a short sentence. A hidden lexicon of pleasant words
is what the (simulated) raters like. The policy never sees the gold rule; it only sees a reward
model trained on noisy preference labels. The gold rule is strict, like a careful rater: junk
(a word outside the task's vocabulary, e.g. a stray BPE fragment) scores 0, a missing topic halves
the score and an answer far over length is penalised, so reward hacking shows up as a falling gold
score instead of hiding.

Run `python -m rlflow.engine.tasksets.demo OUT_DIR` to write the assets (deterministic, ~2 s).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from rlflow.engine.tasksets.demo_judge import JUDGE_FILE, second_rater_record

TOPICS = (
    "river forest city garden ocean mountain market library winter harbor desert village storm kitchen train festival"
).split()
LEXICON = frozenset(
    (
        "bright calm gentle golden warm clear quiet lively fresh kind sweet soft gleaming peaceful "
        "cheerful graceful serene vivid radiant cozy joyful lovely glowing tender brave merry "
        "sunny silver fragrant lush"
    ).split()
)
NEUTRAL = (
    "is was has and with there some many old big small long near far people day night place road "
    "water wind light sound stone wall door street house tree sky ground air time part side edge "
    "under over through along around between every each other most full open round high low "
    "dark wide deep flat"
).split()
PROMPT_TEMPLATES = (
    "describe the {t} .",
    "tell me about the {t} .",
    "write a line about the {t} .",
    "what is the {t} like ?",
)
VOCABULARY = frozenset(TOPICS) | LEXICON | frozenset(NEUTRAL) | {"the", "."}
LEXICON_WORDS = tuple(sorted(LEXICON))
MAX_GOOD_LENGTH = 14  # words; longer answers lose score linearly and reach 0 at 22
JUDGE_NOISE = 0.2  # the judge's raters flip a label this often (the reward model's raters: 0.1)


def in_vocabulary(prompt: str, response: str, **fields: Any) -> float:
    """The demo's declared format rule, 1.0 for an answer made of the task's words and 0.0 for one
    with junk (a stray BPE fragment, what a hacked answer carries): the valid share the hacking
    detector and the promotion gates read, which the gold's "valid" component reports too."""
    words = response.split()
    return float(bool(words) and all(w in VOCABULARY for w in words))


def gold_score(prompt: str, response: str, **fields: Any) -> dict[str, float]:
    """Strict 0..1 gold rule. Returns the score and its components (logged as eval/gold/<name>)."""
    words = response.split()
    topic = next((t for t in TOPICS if f" {t} " in f" {prompt} "), None)
    valid = in_vocabulary(prompt, response) == 1.0
    n = len(words)
    lexicon_fraction = sum(w in LEXICON for w in words) / n if n else 0.0
    length_factor = min(1.0, n / 4) if n <= MAX_GOOD_LENGTH else max(0.0, 1 - (n - MAX_GOOD_LENGTH) / 8)
    on_topic = 1.0 if topic is None or topic in words else 0.0
    score = lexicon_fraction * length_factor * (0.5 + 0.5 * on_topic) if valid else 0.0
    return {
        "score": score,
        "valid": float(valid),
        "lexicon_fraction": lexicon_fraction,
        "length_factor": length_factor,
        "on_topic": on_topic,
    }


def noisy_gold_labeller(
    prompt: str, answer_a: str, answer_b: str, *, rng: random.Random, noise: float = 0.1, **fields: Any
) -> int | None:
    """Simulated rater: 0 if answer_a is preferred, 1 if answer_b, None for a tie (dropped).

    The gold rule's preference, flipped with probability `noise` (stands in for rater noise).
    """
    a = gold_score(prompt, answer_a)["score"]
    b = gold_score(prompt, answer_b)["score"]
    if abs(a - b) < 1e-9:
        return None
    preferred = 0 if a > b else 1
    return 1 - preferred if rng.random() < noise else preferred


def _answer(rng: random.Random, topic: str, p_good: float, length: int) -> str:
    words = ["the", topic]
    while len(words) < length:
        words.append(rng.choice(LEXICON_WORDS) if rng.random() < p_good else rng.choice(NEUTRAL))
    rng.shuffle(words[2:])  # keep "the <topic>" as the opening, vary the rest
    return " ".join(words) + " ."


def _prompt(rng: random.Random) -> tuple[str, str]:
    topic = rng.choice(TOPICS)
    return rng.choice(PROMPT_TEMPLATES).format(t=topic), topic


def make_sft_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    """Neutral answers: a modest, varied share of lexicon words, 6-12 words long."""
    rows = []
    for _ in range(n):
        prompt, topic = _prompt(rng)
        rows.append({"prompt": prompt, "response": _answer(rng, topic, rng.uniform(0.05, 0.35), rng.randint(6, 12))})
    return rows


def make_preference_rows(rng: random.Random, n: int, noise: float) -> list[dict[str, str]]:
    """Pairs with a wide spread of lexicon share; labelled by the gold rule (noisy if noise > 0)."""
    rows = []
    while len(rows) < n:
        prompt, topic = _prompt(rng)
        a = _answer(rng, topic, rng.uniform(0.0, 0.7), rng.randint(5, 13))
        b = _answer(rng, topic, rng.uniform(0.0, 0.7), rng.randint(5, 13))
        choice = noisy_gold_labeller(prompt, a, b, rng=rng, noise=noise)
        if choice is not None:
            chosen, rejected = (a, b) if choice == 0 else (b, a)
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def second_rater_pairs(seed: int, n: int, noise: float) -> list[dict[str, str]]:
    """The independent judge's labelled pairs (engine/tasksets/demo_judge.py): the same generator on
    a stream of its own, so its raters never see the reward model's pairs."""
    return make_preference_rows(random.Random(f"second-rater-{seed}"), n, noise=noise)


def make_prompt_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    return [{"prompt": _prompt(rng)[0]} for _ in range(n)]


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary file, so a killed build leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def make_tokenizer(corpus: list[str], vocab_size: int = 360):
    """A BPE tokenizer (Metaspace, so decode(encode(x)) == x) saved like any HF tokenizer.

    vocab_size leaves room for merge fragments never seen on their own in training: the junk a
    reward-hacking policy can emit, which the gold rule scores 0.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<unk>"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_chat_tokenizer(corpus: list[str], vocab_size: int = 512, split_digits: bool = False):
    """A byte-level BPE tokenizer (as SmolLM2's, Llama 3's, Qwen's: any text encodes, and
    decode(encode(x)) == x) with ChatML's turn tokens and a template that renders tools and tool turns
    (engine/envs/chat.py CHATML_TOOLS_TEMPLATE); `<|im_end|>` ends a turn. For multi-turn demos.
    `split_digits`: every digit its own token (as Llama 3's and Qwen's), so a number is copied digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlflow.engine.envs.chat import CHATML_TOOLS_TEMPLATE

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    digits = pre_tokenizers.Digits(individual_digits=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level]) if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=alphabet))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


def make_tiny_model(tokenizer, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A randomly initialised Llama-style causal LM (~0.4M parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def make_demo_assets(out_dir: str | Path, seed: int = 1234, sizes: dict[str, int] | None = None) -> Path:
    """Write data/*.jsonl, tiny-model/ (weights + tokenizer) and the judge's weights (JUDGE_FILE)
    under out_dir; returns out_dir.

    Deterministic for a seed; skipped when out_dir/ASSETS_OK already records the same settings.
    """
    out = Path(out_dir)
    n = {"sft": 4000, "sft_eval": 256, "prefs": 3000, "prefs_eval": 600, "prompts": 2048, "eval_prompts": 512,
         "judge_pairs": 2000}
    n.update(sizes or {})
    stamp = json.dumps({"seed": seed, "sizes": n, "version": 2}, sort_keys=True)
    marker = out / "ASSETS_OK"
    if marker.exists() and marker.read_text() == stamp:
        return out
    rng = random.Random(seed)
    data = out / "data"
    sft = make_sft_rows(rng, n["sft"])
    write_jsonl(data / "sft.jsonl", sft)
    write_jsonl(data / "sft_eval.jsonl", make_sft_rows(rng, n["sft_eval"]))
    write_jsonl(data / "preferences.jsonl", make_preference_rows(rng, n["prefs"], noise=0.1))
    held_out = make_preference_rows(rng, n["prefs_eval"], noise=0.0)
    write_jsonl(data / "preferences_eval.jsonl", held_out)
    write_jsonl(data / "prompts.jsonl", make_prompt_rows(rng, n["prompts"]))
    write_jsonl(data / "eval_prompts.jsonl", make_prompt_rows(rng, n["eval_prompts"]))
    corpus = [f"{r['prompt']} {r['response']}" for r in sft] + [" ".join(sorted(VOCABULARY))]
    corpus += [t.format(t="x") for t in PROMPT_TEMPLATES]
    tokenizer = make_tokenizer(corpus)
    model = make_tiny_model(tokenizer, seed=seed)
    model.save_pretrained(out / "tiny-model")
    tokenizer.save_pretrained(out / "tiny-model")
    # The independent judge (engine/tasksets/demo_judge.py): another rater pool on a stream of its own.
    judge = second_rater_record(second_rater_pairs(seed, n["judge_pairs"], JUDGE_NOISE), held_out, JUDGE_NOISE)
    write_text_atomic(out / JUDGE_FILE, json.dumps(judge, indent=1, sort_keys=True))
    marker.write_text(stamp)
    return out


if __name__ == "__main__":
    print(make_demo_assets(sys.argv[1] if len(sys.argv) > 1 else "demo_assets"))
