"""The base of the config sections (rlflow.engine.config.base): sections refuse unknown keys and
changes, and a user function must be written "package.module:function"."""

import pytest
from pydantic import ValidationError

from rlflow.engine.config.base import FunctionRef, Section, function_ref


def test_function_refs_must_look_like_module_colon_function():
    for good in ("pkg.mod:fn", "m:_private", "rlflow.engine.tasksets.demo:noisy_gold_labeller"):
        assert function_ref(good) == good
    for bad in ("pkg.mod.fn", "pkg.mod:", ":fn", "1pkg:fn", "pkg:fn.attr", "pkg mod:fn", "pkg:fn()"):
        with pytest.raises(ValueError) as info:
            function_ref(bad)
        assert str(info.value) == f"{bad!r} must look like 'package.module:function'"


def test_a_function_ref_validates_fn_and_binds_no_arguments_by_default():
    ref = FunctionRef(fn="m:f")
    assert (ref.fn, ref.kwargs) == ("m:f", {})
    assert FunctionRef(fn="m:f", kwargs={"noise": 0.1}).kwargs == {"noise": 0.1}
    with pytest.raises(ValidationError, match=r"'m\.f' must look like 'package\.module:function'"):
        FunctionRef(fn="m.f")


def test_sections_refuse_unknown_keys_and_changes_and_document_each_field():
    with pytest.raises(ValidationError) as info:
        FunctionRef(fn="m:f", kwarg={})  # a typo of kwargs must not pass silently
    assert info.value.errors()[0]["type"] == "extra_forbidden" and info.value.errors()[0]["loc"] == ("kwarg",)
    ref = FunctionRef(fn="m:f")
    with pytest.raises(ValidationError):
        ref.fn = "m:g"  # frozen: a config is fixed once built (stage identities hash it)
    # the string under a field is its description: the source of docs/config.md
    assert FunctionRef.model_fields["fn"].description == 'The function, as "package.module:function".'

    class Widget(Section):
        size: int = 3
        """How big."""

    assert Widget().size == 3 and Widget.model_fields["size"].description == "How big."
