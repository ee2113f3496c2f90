"""A config file as YAML text (rlflow.engine.config.yaml_io): bad bytes and bad syntax named by file
and line, and the line of the key a validation error is about."""

import re
from pathlib import Path

import pytest

from rlflow.engine.config.schema import load_config
from rlflow.engine.config.yaml_io import locator, parse_yaml, read_text
from rlflow.engine.errors import ConfigError


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=rf"{path.name}:\d+: not valid YAML"):
        load_config(path)


def test_a_byte_that_is_not_utf8_is_named_by_line_and_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"ppo:\n  steps: 5\n  name: caf\xe9\n")
    # line 3 is "  name: caf" (11 bytes) then 0xe9: the 12th byte of the line
    with pytest.raises(ConfigError) as info:
        read_text(path)
    assert str(info.value) == f"{path}:3: byte 12 of the line (0xe9) is not valid UTF-8; re-save the config as UTF-8"
    path.write_bytes("name: café\n".encode())
    assert read_text(path) == "name: café\n"


def test_parse_errors_name_the_line_and_the_fix():
    path = Path("c.yaml")
    assert parse_yaml(path, "ppo:\n  steps: 5\n") == {"ppo": {"steps": 5}}
    unclosed = "not valid YAML (expected the node content, but found '<stream end>'); fix the syntax there"
    with pytest.raises(ConfigError, match=rf"^c\.yaml:2: {re.escape(unclosed)}$"):
        parse_yaml(path, "a: [1,\n")
    # a control character: PyYAML's reader reports a position, turned into the line it is on
    with pytest.raises(ConfigError, match=r"^c\.yaml:2: not valid YAML \(special characters are not allowed: #x0007\)"):
        parse_yaml(path, "ok: 1\nx: \x07\n")
    # PyYAML builds a date from 2024-13-45 and fails with a ValueError: quoting makes it a string
    with pytest.raises(ConfigError, match=r"^c\.yaml: not valid YAML \(month must be in 1\.\.12\); quote the value$"):
        parse_yaml(path, "d: 2024-13-45\n")
    assert parse_yaml(path, "d: '2024-13-45'\n") == {"d": "2024-13-45"}


def test_the_locator_gives_the_line_of_the_deepest_key_in_the_file_or_says_an_override_set_it():
    text = "ppo:\n  steps: 5\nkl:\n  coef: 0.1\n"
    locate = locator(Path("c.yaml"), text, [])
    assert locate(("ppo", "steps")) == "c.yaml:2"
    assert locate(("kl", "coef")) == "c.yaml:4"
    assert locate(("kl", "target")) == "c.yaml:3"  # not in the file: its section's line
    assert locate(("run", "name")) == "c.yaml"  # nowhere in the file
    overridden = locator(Path("c.yaml"), text, ["kl.coef=0.2"])
    assert overridden(("kl", "coef")) == overridden(("kl",)) == "c.yaml (with overrides)"
    assert overridden(("ppo", "steps")) == "c.yaml:2"
