"""What model a rollout replica serves, in the few numbers that decide whether a trainer's weights fit it.

A trainer's weights fit a replica when the architecture and every shape match; the values do not
matter (the first sync overwrites them all, and the fingerprint guard checks that it did). Weights
that do not fit are worse than refused: vLLM 0.32 ends its engine core when loading raises, so a
wrong replica of someone else's fleet would be killed. So the signature is compared first, before
any weight travels: `rlflow run` checks every `rollout.endpoints` replica against model.path's
config.json before anything trains (flows/preflight.py).

`ServedModel` is the replica's side: ASGI middleware (`--middleware
rlflow.engine.rollout.replica_model.ServedModel`, behind RequireKey) answering GET SIGNATURE_PATH with
the signature of the model the vLLM server loaded (its app state's hf_config). Standard library only:
vLLM's environment imports this module.
"""

from __future__ import annotations

import json
from typing import Any

SIGNATURE_PATH = "/rlflow/model_signature"
SIGNATURE_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
)


def model_signature(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The shape-deciding fields of an HF config.json (as a dict); absent ones are left out."""
    return {key: hf_config[key] for key in SIGNATURE_KEYS if hf_config.get(key) is not None}


def signature_mismatch(served: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """'key: served != expected' for each field both give and that differs."""
    return [
        f"{key} {served[key]} != {expected[key]}"
        for key in SIGNATURE_KEYS
        if key in served and key in expected and served[key] != expected[key]
    ]


class ServedModel:
    """ASGI middleware: GET SIGNATURE_PATH answers the loaded model's signature; everything else passes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != SIGNATURE_PATH or scope.get("method") != "GET":
            await self.app(scope, receive, send)
            return
        config = scope["app"].state.vllm_config.model_config.hf_config  # set before the server listens
        body = json.dumps(model_signature(config.to_dict())).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
