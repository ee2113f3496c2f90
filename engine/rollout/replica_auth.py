"""The key every rollout replica asks for, on every route but /health.

vLLM's own `--api-key` guards only its inference prefixes (/v1, /inference, ...): its RL routes
(/pause, /update_weights, /collective_rpc in dev mode) stay open, and they can replace a fleet's
weights. rlflow starts vLLM with `--middleware rlflow.engine.rollout.replica_auth.RequireKey`.

The key comes from the environment variable REPLICA_KEY_ENV, never from the config, argv, logs or
MLflow. A replica started without it refuses to start. Pure ASGI, no imports beyond the standard
library: vLLM's environment imports this module.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

REPLICA_KEY_ENV = "RLFLOW_REPLICA_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # liveness only: says nothing and changes nothing


class ReplicaKeyMissing(RuntimeError):
    pass


def replica_key() -> str:
    key = os.environ.get(REPLICA_KEY_ENV, "")
    if not key:
        raise ReplicaKeyMissing(
            f"a rollout replica needs an API key: set the environment variable {REPLICA_KEY_ENV}"
            " (rlflow sets it for the replicas it starts; give the same key to an external fleet)"
        )
    return key


def auth_header(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class RequireKey:
    """ASGI middleware: 401 unless `Authorization: Bearer <key>` matches, compared in constant time."""

    def __init__(self, app: Any, key: str | None = None) -> None:
        self.app = app
        self.digest = hashlib.sha256((key or replica_key()).encode()).digest()

    def allowed(self, scope: dict[str, Any]) -> bool:
        if scope.get("path", "") in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.encode("latin-1")).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(given, self.digest)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": "unauthorized: this replica needs its API key"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
