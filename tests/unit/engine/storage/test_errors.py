"""Why a storage URL failed, in one line (rlflow.engine.storage.errors): each kind of fsspec and
botocore error named with its URL's bucket and the fix, and no credential ever in the text."""

import fsspec
import pytest
from botocore.exceptions import NoCredentialsError, PartialCredentialsError

from rlflow.engine.storage.errors import MASK, STORAGE_ERRORS, bucket_of, describe_storage_error


def test_the_bucket_of_an_object_store_url_and_none_for_local_paths():
    assert bucket_of("s3://runs/exp/round_0") == "runs"
    assert bucket_of("gs://b") == "b"
    assert bucket_of("/data/runs") is None and bucket_of("file:///data/runs") is None
    assert bucket_of("s3://") is None


@pytest.mark.parametrize(
    ("url", "exc", "expected"),
    [
        ("/ro/runs", PermissionError("[Errno 13] denied"),
         "permission denied ([Errno 13] denied); fix the file permissions or choose another path"),
        ("s3://runs/x", PermissionError("Forbidden"),
         "access to bucket 'runs' was refused (Forbidden); check the credentials (run.storage_options or the AWS_*"
         " environment) and their permissions on it"),
        ("s3://runs/x", NoCredentialsError(),
         "no credentials for bucket 'runs' were found (NoCredentialsError); set AWS_ACCESS_KEY_ID and"
         " AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, give key and secret in run.storage_options,"
         " or anon: true there for a public bucket"),
        ("s3://nope/x", FileNotFoundError("The specified bucket does not exist"),
         "bucket 'nope' does not exist (The specified bucket does not exist); create it or fix the bucket name in"
         " the URL"),
        ("s3://runs/x", ImportError("Install s3fs to access S3"), "Install s3fs to access S3; install the package for"
         " this URL scheme"),
        ("s3://runs/x", TypeError("__init__() got an unexpected keyword argument 'colour'"),
         "run.storage_options holds an option this filesystem does not take (__init__() got an unexpected keyword"
         " argument 'colour'); remove or rename it"),
        ("s3://runs/x", FileNotFoundError("runs/x/manifest.json"), "FileNotFoundError: runs/x/manifest.json"),
        ("s3://runs/x", OSError(), "OSError: OSError"),  # no text: the type stands in
    ],
)  # fmt: skip
def test_each_kind_of_failure_is_named_with_its_fix(url, exc, expected):
    assert isinstance(exc, STORAGE_ERRORS)
    assert describe_storage_error(url, exc, options_key="run.storage_options") == expected


def test_an_unknown_scheme_from_fsspec_itself_is_named():
    with pytest.raises(STORAGE_ERRORS) as info:
        fsspec.filesystem("nosuchscheme")
    text = describe_storage_error("nosuchscheme://b/x", info.value)
    assert text.startswith("unknown URL scheme 'nosuchscheme://' (") and text.endswith(
        "); use a local path, file://, s3:// or another fsspec protocol"
    )


def test_storage_option_values_are_masked_and_the_text_is_one_line():
    options = {"key": "AKIAEXAMPLEKEY", "secret": "hunter2hunter2", "client_kwargs": {"region_name": "eu"}}
    exc = PartialCredentialsError(provider="env", cred_var="AKIAEXAMPLEKEY")
    assert "AKIAEXAMPLEKEY" not in describe_storage_error("s3://runs/x", exc, options)
    leaky = OSError("signature of AKIAEXAMPLEKEY\nwith hunter2hunter2 did not match")
    text = describe_storage_error("s3://runs/x", leaky, options, "checkpoint.mirror_storage_options")
    assert text == f"OSError: signature of {MASK} with {MASK} did not match"
    assert describe_storage_error("s3://runs/x", leaky) == (
        "OSError: signature of AKIAEXAMPLEKEY with hunter2hunter2 did not match"  # no options: nothing to mask
    )
