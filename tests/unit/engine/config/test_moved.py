"""Keys that moved: the message names the new key, and every new key exists in today's schema."""

import pytest
from pydantic import BaseModel

from rlflow.engine.config.moved import MOVED_KEYS, moved_key_message
from rlflow.engine.config.schema import Config


def _field_at(dotted: str):
    model: type[BaseModel] = Config
    *sections, key = dotted.split(".")
    for part in sections:
        model = model.model_fields[part].annotation
    return model.model_fields.get(key)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_each_old_key_names_a_key_that_exists_and_no_longer_itself(old):
    assert _field_at(MOVED_KEYS[old]) is not None, f"{old} -> {MOVED_KEYS[old]}: no such key"
    section, *rest = old.split(".")
    assert rest[0] not in Config.model_fields[section].annotation.model_fields  # gone from the old section
    message = moved_key_message(tuple(old.split(".")), 1.0)
    assert message.startswith(f"'{old}' moved to '{MOVED_KEYS[old]}'") and message.endswith("rename it there")


def test_the_merged_estimator_says_it_is_one_key_for_both_places():
    message = moved_key_message(("algorithm", "kl_loss_type"), "k3")
    assert "one estimator, used wherever kl.in_loss puts the KL" in message


def test_an_old_section_names_the_keys_it_holds_or_else_all_of_them():
    assert moved_key_message(("ppo", "kl"), {"target": 0.1, "init_coef": 0.2}).startswith(
        "'ppo.kl.init_coef' moved to 'kl.coef'"
    )
    every = moved_key_message(("ppo", "kl"), {})
    assert every.startswith("section 'ppo.kl' moved: ")
    assert all(f"{old.removeprefix('ppo.kl.')} -> {new}" in every for old, new in MOVED_KEYS.items() if old.startswith("ppo.kl."))


def test_any_other_unknown_key_is_not_a_moved_one():
    assert moved_key_message(("ppo", "stepz"), 3) is None
    assert moved_key_message(("kl", "init_coef"), 0.1) is None  # the new section's own typo
