"""Property tests: whatever bytes or documents reach the data and config loaders, they either load
or raise the one clean error the CLI prints on one line (DataError / ConfigError), never another
exception type. Examples stay few (the suite runs on 2 cores); inputs that crashed a loader are
kept as explicit cases so they are replayed on every run."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os

import pandas as pd
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from rlflow.engine.config.schema import Config, build_config, load_config
from rlflow.engine.data.records import load_preference_pairs, load_prompts, load_sft_examples
from rlflow.engine.errors import ConfigError, DataError

# RLFLOW_FUZZ_EXAMPLES=5000 for a long local campaign; no example database is written into the checkout.
FUZZ = settings(
    max_examples=int(os.environ.get("RLFLOW_FUZZ_EXAMPLES", "100")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
LOADERS = (load_sft_examples, load_preference_pairs, load_prompts)
FIELDS = ["prompt", "response", "chosen", "rejected", "messages", "role", "content", "answer"]

SAMPLE_ROWS = [
    {"prompt": "What is 2+2?", "response": "4", "chosen": "4", "rejected": "5"},
    {"prompt": "Name a colour", "response": "blue", "chosen": "blue", "rejected": "7"},
]


def _csv_bytes(rows: list[dict]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def _parquet_bytes(rows: list[dict]) -> bytes:
    out = io.BytesIO()
    pd.DataFrame(rows).to_parquet(out)
    return out.getvalue()


_JSONL = "".join(json.dumps(r) + "\n" for r in SAMPLE_ROWS).encode()
# suffix -> a valid file of that format: mutations of it get past the first byte of each parser.
VALID = {
    ".jsonl": _JSONL,
    ".json": _JSONL,
    ".csv": _csv_bytes(SAMPLE_ROWS),
    ".parquet": _parquet_bytes(SAMPLE_ROWS),
    ".jsonl.gz": gzip.compress(_JSONL),
    ".csv.gz": gzip.compress(_csv_bytes(SAMPLE_ROWS)),
}


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    """`valid` with a few bytes overwritten, a slice cut out, or cut short."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(0, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        start = draw(st.integers(0, len(data)))
        del data[start : start + draw(st.integers(0, 16))]
    return bytes(data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data)


def file_bytes(suffix: str) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=300), mutated(VALID[suffix]))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def assert_loads_or_clean_error(error_type: type[Exception], call, *args) -> None:
    try:
        call(*args)
    except error_type as exc:
        message = str(exc)
        assert message and "\n" not in message and "Traceback" not in message, message


# --------------------------------------------------------------------------- data loaders


@pytest.mark.parametrize("suffix", list(VALID))
@FUZZ
@given(data=st.data())
def test_data_loaders_on_random_bytes(folder, suffix, data):
    path = folder / f"random{suffix}"
    path.write_bytes(data.draw(file_bytes(suffix)))
    for loader in LOADERS:
        assert_loads_or_clean_error(DataError, loader, str(path))


# Inputs that once crashed a loader (or would have): replayed for every format on every run.
KNOWN_BAD = [
    b"\xff\xfe\x00",  # not UTF-8 on line 1
    b'{"prompt": 1' + b"0" * 5000 + b"}\n",  # an int past Python's 4300-digit limit: ValueError
    b"[" * 100_000 + b"\n",  # nesting deeper than the stack: RecursionError
    b"prompt\n\x00\n",  # a NUL byte
    b"\x1f\x8b\x08\x00garbage",  # a gzip header with a corrupt body
    b"PAR1\x00\x00\x00\x00PAR1",  # Parquet magic around nothing
]


def test_parquet_with_non_utf8_text_names_row_and_column(folder):
    # Found by hypothesis: one byte of a string column overwritten made Arrow raise UnicodeDecodeError.
    valid = VALID[".parquet"]
    broken = valid.replace(b"\x04\x00\x00\x00blue", b"\x04\x00\x00\x00\x80lue", 1)
    assert broken != valid
    path = folder / "non-utf8.parquet"
    path.write_bytes(broken)
    with pytest.raises(DataError) as info:
        load_sft_examples(str(path))
    assert str(info.value).startswith(f"{path}:2: column 'response'") and "not valid UTF-8" in str(info.value)
    # ... and in a column name (the schema): the name cannot be shown, its position can.
    path.write_bytes(valid.replace(b"\x18\x08response", b"\x18\x08\x80esponse", 1))
    with pytest.raises(DataError, match=r"the name of column \d is not valid UTF-8"):
        load_sft_examples(str(path))


@pytest.mark.parametrize("suffix", list(VALID))
def test_data_loaders_on_known_bad_bytes(folder, suffix):
    path = folder / f"known{suffix}"
    for payload in KNOWN_BAD + [VALID[suffix][: len(VALID[suffix]) // 2]]:
        path.write_bytes(payload)
        for loader in LOADERS:
            assert_loads_or_clean_error(DataError, loader, str(path))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), inner),
    max_leaves=8,
)
json_rows = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), json_values, max_size=5)


@FUZZ
@given(rows=st.lists(json_rows | json_values, min_size=0, max_size=4))
def test_data_loaders_on_random_json_rows(folder, rows):
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for loader in LOADERS:
        assert_loads_or_clean_error(DataError, loader, str(path))


@FUZZ
@given(cells=st.lists(st.lists(st.text(max_size=10), min_size=1, max_size=4), min_size=1, max_size=4))
def test_data_loaders_on_random_csv_cells(folder, cells):
    out = io.StringIO()
    csv.writer(out).writerows([["prompt", "response", "chosen", "rejected"][: len(cells[0])], *cells])
    path = folder / "cells.csv"
    path.write_text(out.getvalue())
    for loader in LOADERS:
        assert_loads_or_clean_error(DataError, loader, str(path))


# --------------------------------------------------------------------------- config loader


def _key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _key_paths(annotation, f"{prefix}{name}.")
    return paths


KEY_PATHS = _key_paths(Config)
yaml_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["1e3", "2024-13-45", "0x1F", "~", "[1,", "{a: 1}", "!!python/name:os.system", ".inf"])
)
yaml_values = st.recursive(
    yaml_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def config_trees(draw) -> dict:
    """Nested dicts along the real key paths (so validation goes deep), with random values."""
    tree: dict = {}
    for path in draw(st.lists(st.sampled_from(KEY_PATHS), max_size=6)):
        node = tree
        parts = path.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[parts[-1]] = draw(yaml_values)
    return tree


@FUZZ
@given(tree=config_trees() | yaml_values)
def test_build_config_on_random_trees(tree):
    assert_loads_or_clean_error(ConfigError, build_config, tree, "fuzz")


@FUZZ
@given(document=st.one_of(st.binary(max_size=200), config_trees().map(yaml.safe_dump).map(str.encode)))
@example(document=b"run:\n  seed: 2024-13-45\n")  # PyYAML builds dates: a ValueError, not a YAMLError
@example(document=b"ppo:\n  steps: \xff\n")  # not UTF-8
@example(document=b"ppo: {rollout_batch: 1000000000000000001, mini_batch: 1000000000000000000}\n")
def test_load_config_on_random_documents(folder, document):
    path = folder / "fuzz.yaml"
    path.write_bytes(document)
    assert_loads_or_clean_error(ConfigError, load_config, path)


overrides = st.one_of(
    st.text(max_size=30),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEY_PATHS) | st.text(max_size=8), st.text(max_size=12)),
    st.builds(lambda k, v: f"{k}={yaml.safe_dump(v).strip()}", st.sampled_from(KEY_PATHS), yaml_values),
)


@FUZZ
@given(texts=st.lists(overrides, max_size=3))
@example(texts=["run.seed=2024-13-45"])
@example(texts=["ppo=1", "rl.steps=2"])
def test_load_config_on_random_overrides(folder, texts):
    path = folder / "base.yaml"
    path.write_text("ppo:\n  steps: 5\n")
    assert_loads_or_clean_error(ConfigError, load_config, path, texts)
