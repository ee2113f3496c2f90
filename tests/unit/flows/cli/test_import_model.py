"""`rlflow import-model` called in-process: a source that is no GGUF checkpoint is refused before
anything is written."""

import argparse

import pytest

from rlflow.engine.errors import RlflowError
from rlflow.flows.cli.import_model import command_import_model


def test_a_source_that_is_not_a_gguf_is_refused_and_nothing_is_written(tmp_path, capsys):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"not a gguf file at all")
    dest = tmp_path / "out"
    args = argparse.Namespace(src=str(src), dest=str(dest), dtype="float32")
    with pytest.raises(RlflowError, match="model.gguf"):
        command_import_model(args)
    assert not dest.exists() and capsys.readouterr().out == ""
