"""Why a storage URL (local path, s3://, gs://, ...) could not be read or written, in one line.

fsspec and its backends report a missing bucket, refused credentials, an unknown URL scheme or
a storage option the backend does not take as assorted exception types whose text names neither
the URL nor a fix. `describe_storage_error` turns them into words that name the URL and its
bucket, and never a credential: values from the storage options are masked out of the text.
"""

from __future__ import annotations

from typing import Any

from rlflow.engine.config.secrets import secret_strings

# Exceptions opening or reading a URL can raise that mean "this URL or its options are wrong",
# not a bug: OSError (missing, forbidden, network), ValueError (unknown scheme, bad URL),
# ImportError (backend package not installed), TypeError (an option the backend does not take).
# botocore's "no credentials found" errors (s3fs lets them through unwrapped) mean the same.
try:
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    CREDENTIAL_ERRORS: tuple[type[BaseException], ...] = (NoCredentialsError, PartialCredentialsError)
except ImportError:  # pragma: no cover - no S3 backend installed
    CREDENTIAL_ERRORS = ()
STORAGE_ERRORS = (OSError, ValueError, ImportError, TypeError, *CREDENTIAL_ERRORS)
MASK = "***"


def bucket_of(url: str) -> str | None:
    """The bucket (or host) of an object-store URL, None for a local path."""
    if "://" not in url or url.startswith("file://"):
        return None
    return url.split("://", 1)[1].split("/", 1)[0] or None


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _reason(url: str, exc: BaseException, options_key: str) -> str:
    text = _one_line(exc) or type(exc).__name__
    bucket = bucket_of(url)
    if isinstance(exc, PermissionError) and not bucket:
        return f"permission denied ({text}); fix the file permissions or choose another path"
    if isinstance(exc, PermissionError):
        return (
            f"access to bucket {bucket!r} was refused ({text}); check the credentials ({options_key} or the AWS_*"
            " environment) and their permissions on it"
        )
    if isinstance(exc, CREDENTIAL_ERRORS):
        return (
            f"no credentials for bucket {bucket!r} were found ({type(exc).__name__}); set AWS_ACCESS_KEY_ID and"
            f" AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, give key and secret in {options_key},"
            " or anon: true there for a public bucket"
        )
    if isinstance(exc, FileNotFoundError) and bucket and "bucket" in text.lower():
        return f"bucket {bucket!r} does not exist ({text}); create it or fix the bucket name in the URL"
    if isinstance(exc, ValueError) and "protocol" in text.lower():
        scheme = url.split("://", 1)[0]
        return f"unknown URL scheme '{scheme}://' ({text}); use a local path, file://, s3:// or another fsspec protocol"
    if isinstance(exc, ImportError):
        return f"{text}; install the package for this URL scheme"
    if isinstance(exc, TypeError):  # s3fs & co. pass their options to a constructor
        return f"{options_key} holds an option this filesystem does not take ({text}); remove or rename it"
    return f"{type(exc).__name__}: {text}"


def describe_storage_error(
    url: str, exc: BaseException, storage_options: Any = None, options_key: str = "storage_options"
) -> str:
    """One line saying why `url` failed, with any storage-option value (a credential) masked;
    `options_key` is the config key the user fixes options and credentials under."""
    text = _reason(url, exc, options_key)
    for secret in secret_strings(storage_options):
        text = text.replace(secret, MASK)
    return text
