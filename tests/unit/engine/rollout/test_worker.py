"""The rollout worker in this process: the wire format over a real socket pair, request parsing,
and the tiny demo model's transformers backend (its request loop: test_worker_session.py)."""

import pytest
import torch

from helpers.worker_wire import REQUEST
from rlflow.engine.data.batching import left_pad
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.models.tokens import response_mask_from_ids
from rlflow.engine.rollout.generate import sample_tokens
from rlflow.engine.rollout.worker_session import parse_args
from rlflow.engine.rollout.worker import (
    PREFIX,
    GenerateRequest,
    PeerClosed,
    ProtocolError,
    RequestError,
    recv_message,
    send_message,
)


def test_a_message_round_trips_header_and_payload(pair):
    a, b = pair
    send_message(a, {"op": "x", "n": [1, 2]}, b"\x01\x02\x03")
    send_message(a, {"op": "empty"})
    header, payload = recv_message(b)
    assert header == {"op": "x", "n": [1, 2]} and bytes(payload) == b"\x01\x02\x03"
    into = bytearray(8)
    header, payload = recv_message(b, lambda n: memoryview(into))
    assert header == {"op": "empty"} and payload.nbytes == 0


def test_a_foreign_prefix_is_a_protocol_error_and_a_closed_peer_is_peer_closed(pair):
    a, b = pair
    a.sendall(PREFIX.pack(b"HTTP", 2, 0))  # refused before its header is read
    with pytest.raises(ProtocolError, match="another protocol version"):
        recv_message(b)
    a.sendall(PREFIX.pack(b"RLF1", 10, 0)[:8])
    a.close()
    with pytest.raises(PeerClosed, match="after 8 of 16 bytes"):
        recv_message(b)


def test_a_generate_request_round_trips_and_bad_ones_are_request_errors():
    request = GenerateRequest.from_json(REQUEST)
    assert GenerateRequest.from_json(request.to_json()) == request and request.to_json()["op"] == "generate"
    with pytest.raises(RequestError, match="malformed generate request .KeyError"):
        GenerateRequest.from_json({k: v for k, v in REQUEST.items() if k != "seed"})
    for bad in ({"prompts": [[1], []]}, {"temperature": 0}, {"max_new_tokens": 0}):
        with pytest.raises(RequestError, match="non-empty prompts, temperature > 0 and max_new_tokens >= 1"):
            GenerateRequest.from_json(REQUEST | bad)
    with pytest.raises(RequestError, match="at least one stop token id"):
        GenerateRequest.from_json(REQUEST | {"stop_token_ids": []})


def test_generate_returns_the_samplers_tokens_up_to_each_stop(backend):
    result = backend.generate(GenerateRequest.from_json(REQUEST))
    ids, attention = left_pad(REQUEST["prompts"], 0)
    expected = sample_tokens(backend.model, ids, attention, SamplingParams(1.0, 1.0, 6), [0], 0, 2)
    keep = response_mask_from_ids(expected.tokens, [0]).bool()
    assert result.lengths == keep.sum(1).tolist()
    assert torch.equal(result.ids, expected.tokens[keep])
    assert torch.allclose(result.logprobs, expected.logprobs[keep])
    assert len(result.payload()) == sum(result.lengths) * (8 + 4)  # int64 ids, then float32 log-probs


def test_worker_arguments_default_to_float32_and_torchs_threads():
    args = parse_args(["--socket", "/tmp/s", "--model-dir", "/m", "--parent-pid", "12"])
    assert (args.dtype, args.threads, args.trust_remote_code, args.parent_pid) == ("float32", 0, False, 12)
