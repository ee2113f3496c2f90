"""The replica key: every route but /health refuses a request without it."""

from __future__ import annotations

import asyncio

import pytest

from rlflow.engine.rollout.replica_auth import REPLICA_KEY_ENV, ReplicaKeyMissing, RequireKey


def asgi_call(middleware, path, headers=()):
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": list(headers)}
    asyncio.run(middleware.__class__(app, key="sesame")(scope, None, send))
    return sent[0]["status"]


def test_every_route_but_health_wants_the_key_in_constant_time():
    guard = RequireKey(None, key="sesame")
    for path in ("/update_weights", "/pause", "/collective_rpc", "/inference/v1/generate", "/metrics"):
        assert asgi_call(guard, path) == 401
        assert asgi_call(guard, path, [(b"authorization", b"Bearer wrong")]) == 401
        assert asgi_call(guard, path, [(b"authorization", b"Basic sesame")]) == 401
        assert asgi_call(guard, path, [(b"authorization", b"Bearer sesame")]) == 200
    assert asgi_call(guard, "/health") == 200


def test_a_replica_without_a_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv(REPLICA_KEY_ENV, raising=False)
    with pytest.raises(ReplicaKeyMissing, match=REPLICA_KEY_ENV):
        RequireKey(None)
