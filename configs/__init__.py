"""The shipped configs and device prices, installed as the data package rlflow.configs so that a
wheel install finds them too (`shipped_file`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_file(name: str) -> Path:
    """A file of this folder wherever rlflow is installed (source tree, editable, wheel)."""
    return Path(str(resources.files(__name__).joinpath(name)))
