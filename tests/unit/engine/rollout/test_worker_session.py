"""The rollout worker's request loop in this process, on the tiny demo model's transformers backend:
weight loads and their counters, errors sent back as replies, the loop ending on shutdown, control
messages served before queued generations, and a partial rollout cut by a weight update whose
continuation is sampled by the new weights (checked against the trainer-side log-probs)."""

import threading
import time

import pytest
import torch

from helpers.worker_wire import REQUEST
from rlflow.engine.data.batching import left_pad
from rlflow.engine.models.loading import token_logprobs
from rlflow.engine.rollout.weight_sync import iter_buckets, pack_bucket, weights_fingerprint
from rlflow.engine.rollout.worker import GenerateRequest, HFBackend, RequestError, recv_message, send_message
from rlflow.engine.rollout.worker_session import Inbox, WorkerSession





def _packed(bucket) -> memoryview:
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, buffer)
    return memoryview(buffer.numpy())


def _bucket_header(bucket, index=0):
    return {"op": "load_bucket", "tensors": [e.to_json() for e in bucket.entries], "nbytes": bucket.nbytes,
            "index": index}  # fmt: skip


def test_an_inline_update_replaces_the_weights_and_counts_buckets_tensors_and_bytes(backend):
    session = WorkerSession(sock=None, backend=backend)
    new = {n: torch.full_like(p, 0.5) for n, p in list(backend.model.named_parameters())[:3]}
    assert session.handle({"op": "begin_update"}, memoryview(b""))[0] == {"ok": True}
    for i, bucket in enumerate(iter_buckets(new.items(), bucket_bytes=1)):  # one tensor per bucket
        assert session.handle(_bucket_header(bucket, i), _packed(bucket))[0] == {"ok": True, "index": i}
    reply, _ = session.handle({"op": "end_update", "version": 4}, memoryview(b""))
    assert reply == {"ok": True, "buckets": 3, "tensors": 3, "bytes": sum(t.numel() * 4 for t in new.values())}
    assert session.version == 4
    for name, value in new.items():
        assert torch.equal(backend.params[name], value)
    reply, _ = session.handle({"op": "fingerprint"}, memoryview(b""))
    assert reply["fingerprint"] == weights_fingerprint(backend.model.named_parameters())


def test_a_tensor_the_model_lacks_or_of_another_shape_is_refused(backend):
    session = WorkerSession(sock=None, backend=backend)
    name, param = next(iter(backend.model.named_parameters()))
    for tensors, message in (
        ([("no.such.weight", torch.zeros(2))], "worker model has no parameter 'no.such.weight'"),
        ([(name, torch.zeros(param.numel() + 1))], f"parameter '{name}' has shape"),
    ):
        (bucket,) = iter_buckets(tensors, bucket_bytes=1 << 30)
        with pytest.raises(RequestError, match=message):
            session.handle(_bucket_header(bucket), _packed(bucket))
    with pytest.raises(RequestError, match="load_bucket from staging before attach_staging"):
        session.handle(_bucket_header(bucket) | {"source": "staging", "offset": 0}, _packed(bucket))


def test_the_loop_answers_errors_as_replies_and_ends_on_shutdown(pair, backend):
    trainer, worker = pair
    session = WorkerSession(worker, backend)
    thread = threading.Thread(target=session.serve)
    thread.start()
    try:
        send_message(trainer, {"op": "dance"})
        reply = recv_message(trainer)[0]
        assert reply.pop("idle_s") >= 0 and reply == {"ok": False, "error": "unknown op 'dance'", "op": "dance"}
        time.sleep(0.2)  # the worker waits for the next request: idle time, reported with every reply
        send_message(trainer, REQUEST | {"op": "generate", "id": 7})
        reply, payload = recv_message(trainer)
        assert reply["ok"] and payload.nbytes == sum(reply["lengths"]) * 12
        assert reply["idle_s"] >= 0.2 and reply["id"] == 7 and reply["segments"] == [[[0, 0]], [[0, 0]]]
        send_message(trainer, {"op": "shutdown"})
        reply = recv_message(trainer)[0]
        assert reply.pop("idle_s") >= 0.2 and reply == {"ok": True, "op": "shutdown"}
    finally:
        thread.join(30)
    assert not thread.is_alive()


def _wait_for(inbox: Inbox, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(inbox.items) < count:
        assert time.monotonic() < deadline, "the reader thread did not deliver the messages"
        time.sleep(0.01)


def test_control_messages_come_before_a_priority_generation_and_that_before_the_others(pair):
    trainer, worker = pair
    inbox = Inbox(worker)
    for header in ({"op": "generate", "id": 0}, {"op": "generate", "id": 1, "priority": True},
                   {"op": "begin_update"}, {"op": "generate", "id": 2}, {"op": "end_update"}):  # fmt: skip
        send_message(trainer, header)
    _wait_for(inbox, 5)
    assert inbox.control_pending()
    assert inbox.next(control_only=True)[0]["op"] == "begin_update"
    assert inbox.next()[0]["op"] == "end_update" and not inbox.control_pending()
    assert [inbox.next()[0]["id"] for _ in range(3)] == [1, 0, 2]
    trainer.close()
    assert inbox.next() is None  # the peer left and nothing is queued


def test_a_partial_rollout_goes_on_under_the_update_that_cut_it(pair, backend, small_assets):
    """The whole update is already queued when the generation starts: its first token is sampled
    by version 0, then the update is served and every later token comes from version 1's weights."""
    trainer, worker = pair
    session = WorkerSession(worker, backend)
    session.inbox = Inbox(worker)
    old = HFBackend(str(small_assets / "tiny-model"), "float32").model
    new = {n: p.detach() * 0.9 for n, p in backend.model.named_parameters()}
    send_message(trainer, {"op": "begin_update"})
    buckets = list(iter_buckets(new.items(), bucket_bytes=1 << 30))
    for i, bucket in enumerate(buckets):
        send_message(trainer, _bucket_header(bucket, i), _packed(bucket))
    send_message(trainer, {"op": "end_update", "version": 1})
    _wait_for(session.inbox, 2 + len(buckets))
    request = GenerateRequest.from_json(REQUEST | {"max_new_tokens": 8, "stop_token_ids": [10**6]})
    result, segments = session.generate(request, interruptible=True)
    assert segments == [[[0, 0], [1, 1]], [[0, 0], [1, 1]]] and result.lengths == [8, 8]
    replies = [recv_message(trainer)[0]["op"] for _ in range(2 + len(buckets))]
    assert replies == ["begin_update"] + ["load_bucket"] * len(buckets) + ["end_update"]
    ids, attention = left_pad(request.prompts, 0)
    response = result.ids.view(2, 8)
    full, mask = torch.cat([ids, response], 1), torch.cat([attention, torch.ones_like(response)], 1)
    with torch.no_grad():
        by_old = token_logprobs(old, full, mask, ids.shape[1])[0]
        by_new = token_logprobs(backend.model, full, mask, ids.shape[1])[0]
    sampled = result.logprobs.view(2, 8)
    torch.testing.assert_close(sampled[:, :1], by_old[:, :1], atol=1e-5, rtol=0)
    torch.testing.assert_close(sampled[:, 1:], by_new[:, 1:], atol=1e-5, rtol=0)
    assert (sampled[:, 1:] - by_old[:, 1:]).abs().max() > 1e-3  # the two policies do differ there
