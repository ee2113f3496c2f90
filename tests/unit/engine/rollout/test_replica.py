"""The replica client's checks without a server: what a malformed answer, a credential in a URL or an
unreachable replica become."""

from __future__ import annotations

import math
import time

import pytest
import requests

from rlflow.engine.config.secrets import redact_url
from rlflow.engine.rollout.replica import ReplicaClient, ReplicaError, row_seed, version_label


class Tokenizer:
    eos_token_id = 2
    pad_token_id = 0


@pytest.fixture
def client():
    client = ReplicaClient("http://user:pw@127.0.0.1:9/", "k", Tokenizer(), run_tag="run-a")
    yield client
    client.close()


def answer(ids, logprobs, spans=None):
    content = [{"token_id": t, "logprob": x} for t, x in zip(ids, logprobs)]
    spans = spans if spans is not None else [{"version": "run-a:3", "start": 0, "end": len(ids)}]
    return {"choices": [{"token_ids": ids, "logprobs": {"content": content}, "weight_versions": spans}]}


def test_a_well_formed_answer_is_ids_logprobs_and_versions(client):
    spans = [{"version": "run-a:3", "start": 0, "end": 2}, {"version": "run-a:4", "start": 2, "end": 3}]
    ids, logprobs, versions = client._parse_row(answer([5, 6, 2], [-0.5, -1.0, 0.0], spans), max_tokens=4)
    assert (ids, logprobs, versions) == ([5, 6, 2], [-0.5, -1.0, 0.0], [3, 3, 4])


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (answer([5, 6, 7, 8, 9], [-1.0] * 5), "answered 5 tokens; asked for 1 to 4"),
        (answer([], []), "answered 0 tokens"),
        (answer([5, 6], [-1.0]), "answered 2 tokens but 1 log-probs"),
        (answer([5, 6], [-1.0, math.nan]), "answered log-prob nan"),
        (answer([5, 6], [-1.0, 0.25]), "answered log-prob 0.25"),
        (answer([5], [-1.0], [{"version": "default", "start": 0, "end": 1}]), "weight version 'default'"),
        (answer([5], [-1.0], [{"version": "run-b:3", "start": 0, "end": 1}]), "weight version 'run-b:3'"),
        (
            answer([5, 6], [-1.0, -1.0], [{"version": "run-a:3", "start": 0, "end": 1}]),
            "tokens without a weight version",
        ),
        ({"choices": []}, "without token ids and log-probs"),
        ({"choices": [{"token_ids": [1]}]}, "without token ids and log-probs"),
    ],
)
def test_a_malformed_answer_is_an_error_naming_the_replica(client, reply, message):
    with pytest.raises(ReplicaError, match="rollout replica http://\\*\\*\\*@127.0.0.1:9/: ") as caught:
        client._parse_row(reply, max_tokens=4)
    assert message in str(caught.value)
    assert "pw" not in str(caught.value)


def test_credentials_in_an_endpoint_url_are_redacted():
    assert redact_url("https://alice:s3cret@fleet.example:8000/v") == "https://***@fleet.example:8000/v"
    assert redact_url("http://10.0.0.7:8000") == "http://10.0.0.7:8000"


def test_row_seeds_differ_per_row_and_versions_carry_the_run():
    assert len({row_seed(7, i) for i in range(64)}) == 64
    assert row_seed(7, 0) != row_seed(8, 0)
    assert version_label("run-a", 12) == "run-a:12"


def test_an_unreachable_replica_is_an_error_not_a_hang():
    client = ReplicaClient("http://127.0.0.1:9", "k", Tokenizer(), name="r0", timeout_s=5)
    with pytest.raises(ReplicaError, match="rollout replica r0: /pause could not connect"):
        client.pause()
    client.close()


def test_a_generate_call_of_more_rows_than_a_replica_takes_in_flight_names_the_key():
    from rlflow.engine.rollout.replica import RowRequests

    rows = RowRequests(2, "rollout replica hf-0")
    with pytest.raises(ReplicaError, match=r"3 rows in one generate call, more than the 2 .*rollout.generate_batch"):
        rows.submit(lambda *a: None, [[1], [2], [3]], None, 0, tokenizer=None)
    rows.close()


def answer_once(head_and_part_of_body: bytes, hold_s: float):
    """A one-request server on 127.0.0.1 that reads the whole request, sends these bytes, holds the
    connection `hold_s` seconds and closes it; (url, thread)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:  # the request's head (these requests have no body)
                chunk = conn.recv(65536)
                if not chunk:  # the client gave up first
                    break
                request += chunk
            conn.sendall(head_and_part_of_body)
            time.sleep(hold_s)
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


HALF_AN_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 172\r\n\r\n{"


def test_a_replica_that_dies_mid_answer_is_an_error_naming_it():
    """Headers, then half a body, then the socket closes: what a killed replica leaves behind."""
    url, server = answer_once(HALF_AN_ANSWER, hold_s=0)
    client = ReplicaClient(url, "k", Tokenizer(), name="r0", timeout_s=5)
    with pytest.raises(ReplicaError, match=r"rollout replica r0: /pause broke off its answer \(ChunkedEncodingError\)"):
        client.pause()
    client.close()
    server.join(timeout=5)


def test_a_replica_that_stalls_mid_answer_is_a_timeout_naming_it():
    """Headers, then half a body, then nothing (a replica stopped mid-answer): requests calls the read
    timeout a ConnectionError there; it is still the response timeout, not a failed connect."""
    url, server = answer_once(HALF_AN_ANSWER, hold_s=6)
    client = ReplicaClient(url, "k", Tokenizer(), name="r0", timeout_s=3)  # the head comes at once, the rest never
    no_answer = r"r0: /pause got no answer within 3 s \(rollout.response_timeout_s\)"
    with pytest.raises(ReplicaError, match=no_answer) as info:
        client.pause()
    assert isinstance(info.value.__context__, requests.ConnectionError)  # the case this test is for
    client.close()
    server.join(timeout=10)
