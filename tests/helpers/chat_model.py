"""A tiny Llama with the demo's byte-level chat tokenizer, saved as a Hugging Face directory, and RL
prompt files for it: what the multi-turn tests train."""

import json
from pathlib import Path

from rlflow.engine.tasksets.demo import make_chat_tokenizer, make_tiny_model

CORPUS = ["what is 12 plus 30", "the answer is 42", "tool says 17 and 34", "result 17"]


def write_chat_model(root: Path, rows: list[dict]) -> Path:
    """root/model (weights + tokenizer), root/prompts.jsonl and root/eval_prompts.jsonl (both `rows`)."""
    tokenizer = make_chat_tokenizer(CORPUS)
    make_tiny_model(tokenizer, seed=0).save_pretrained(root / "model", safe_serialization=True)
    tokenizer.save_pretrained(root / "model")
    for name in ("prompts", "eval_prompts"):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root
