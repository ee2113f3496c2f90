"""What identifies a model: a hub id's shape, the names a scalar head goes by, and the
fingerprint of a starting model's files (stage identities include it)."""

from __future__ import annotations

import hashlib
import os
import re

try:  # progress bars per checkpoint drown the per-step progress lines
    from transformers.utils import logging as _hf_logging

    _hf_logging.disable_progress_bar()
    _hf_logging.set_verbosity_error()  # load reports for heads we initialise on purpose
except ImportError:  # pragma: no cover
    pass

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SCALAR_HEAD_NAMES = ("score", "classifier", "v_head")


def model_fingerprint(path: str) -> str:
    """Identity of a starting model: for a local directory, sha256 over its config and, per
    weight file, name, size and the first and last MiB (cheap even at 140 GB, and it changes
    when the weights do); a GGUF file the same way as one weight file; for a hub id, the id itself
    (pin a revision by using a local copy)."""
    if os.path.isfile(path):
        folder, names = os.path.split(path)
    elif os.path.isdir(path):
        folder, names = path, sorted(os.listdir(path))
    else:
        return path
    digest = hashlib.sha256()
    for name in names if isinstance(names, list) else [names]:
        full = os.path.join(folder, name)
        if not os.path.isfile(full):
            continue
        size = os.path.getsize(full)
        digest.update(f"{name}:{size}".encode())
        with open(full, "rb") as f:
            if name.endswith(".json") or size <= 2 * 2**20:
                digest.update(f.read())
            else:
                digest.update(f.read(2**20))
                f.seek(-(2**20), os.SEEK_END)
                digest.update(f.read(2**20))
    return f"sha256:{digest.hexdigest()}"
