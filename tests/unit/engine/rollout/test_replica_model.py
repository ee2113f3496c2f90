"""The model signature a replica serves and the trainer expects: the shape-deciding fields of an HF
config, compared field by field (the real server's answer: tests/unit/engine/rollout/test_fleet.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from rlflow.engine.rollout.replica_model import SIGNATURE_PATH, ServedModel, model_signature, signature_mismatch

SMOL = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "tie_word_embeddings": True,
    "rope_theta": 100000, "torch_dtype": "bfloat16",
}


def test_the_signature_keeps_the_shape_deciding_fields_only():
    signature = model_signature(SMOL | {"num_key_value_heads": None})
    assert "rope_theta" not in signature and "torch_dtype" not in signature and "num_key_value_heads" not in signature
    assert signature["hidden_size"] == 576 and signature["architectures"] == ["LlamaForCausalLM"]


def test_a_mismatch_names_each_field_that_differs_and_ignores_what_one_side_leaves_out():
    assert signature_mismatch(model_signature(SMOL), model_signature(SMOL)) == []
    other = model_signature(SMOL | {"hidden_size": 64, "num_hidden_layers": 2})
    assert signature_mismatch(other, model_signature(SMOL)) == ["hidden_size 64 != 576", "num_hidden_layers 2 != 30"]
    partial = {k: v for k, v in model_signature(SMOL).items() if k != "vocab_size"}
    assert signature_mismatch(partial, model_signature(SMOL | {"vocab_size": 1})) == []


def call(middleware: ServedModel, path: str, method: str = "GET") -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    config = SimpleNamespace(to_dict=lambda: SMOL)
    model_config = SimpleNamespace(hf_config=config)
    app = SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config)))
    scope = {"type": "http", "path": path, "method": method, "app": app}
    asyncio.run(middleware(scope, None, send))
    return sent


def test_the_middleware_answers_its_path_and_passes_everything_else_on():
    passed = []

    async def inner(scope, receive, send):
        passed.append(scope["path"])

    middleware = ServedModel(inner)
    start, body = call(middleware, SIGNATURE_PATH)
    assert start["status"] == 200 and json.loads(body["body"]) == model_signature(SMOL)
    assert call(middleware, "/v1/models") == [] and call(middleware, SIGNATURE_PATH, "POST") == []
    assert passed == ["/v1/models", SIGNATURE_PATH]
