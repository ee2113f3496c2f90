"""Shared fixtures for engine tests: an in-process S3 (moto) server for the whole session."""
import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_bucket():
    """Yield (bucket_url, storage_options) for a fresh bucket on a local moto S3 server."""
    pytest.importorskip("moto")
    s3fs = pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    # botocore reads credentials and region from the environment; region must not be passed
    # as client_kwargs or bucket creation fails against moto.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(var, raising=False)
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        try:
            options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
            s3fs.S3FileSystem(**options).mkdir("rlflow-test")
            yield "s3://rlflow-test", options
        finally:
            server.stop()
