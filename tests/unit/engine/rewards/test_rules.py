"""The built-in rule rewards (engine/rewards/rules.py): hand-computed scores and config errors."""

import pytest

from rlflow.engine.errors import ConfigError
from rlflow.engine.rewards.rules import RULES, make_rule


def score(rule_type, kwargs, response, fields=None):
    return make_rule(rule_type, kwargs, "src")("a prompt", response, fields or {})


def test_keyword_modes_match_whole_words():
    words = {"keywords": ["cat", "dog", "C++"]}
    assert score("keyword", words, "My Cat and I") == 1.0  # any, ignoring case
    assert score("keyword", words, "concatenate the hotdogs") == 0.0  # whole words only
    assert score("keyword", words | {"mode": "all"}, "cat, dog and C++.") == 1.0
    assert score("keyword", words | {"mode": "all"}, "cat and dog") == 0.0
    assert score("keyword", words | {"mode": "fraction"}, "cat and dog") == pytest.approx(2 / 3)
    assert score("keyword", words | {"ignore_case": False}, "CAT") == 0.0
    assert score("keyword", {"keywords": ["thank you"]}, "Thank  you!") == 0.0  # a phrase is matched as written
    assert score("keyword", {"keywords": ["thank you"]}, "Thank you!") == 1.0
    assert score("keyword", words, "") == 0.0


def test_regex_search_full_match_and_case():
    assert score("regex", {"pattern": r"\d+"}, "answer: 42") == 1.0
    assert score("regex", {"pattern": r"\d+", "full_match": True}, "answer: 42") == 0.0
    assert score("regex", {"pattern": r"\d+", "full_match": True}, "42") == 1.0
    assert score("regex", {"pattern": "yes"}, "YES") == 0.0
    assert score("regex", {"pattern": "yes", "ignore_case": True}, "YES") == 1.0
    assert score("regex", {"pattern": "^$", "full_match": True}, "") == 1.0


def test_length_scores_distance_to_the_target():
    ten = {"target": 10}
    assert score("length", ten, " ".join(["w"] * 10)) == 1.0
    assert score("length", ten, " ".join(["w"] * 15)) == 0.5  # 1 - 5/10
    assert score("length", ten, " ".join(["w"] * 7)) == pytest.approx(0.7)
    assert score("length", ten, " ".join(["w"] * 25)) == 0.0  # floored at 0
    assert score("length", ten, "") == 0.0
    assert score("length", ten | {"tolerance": 2}, " ".join(["w"] * 12)) == 1.0  # inside the band
    assert score("length", ten | {"tolerance": 2}, " ".join(["w"] * 13)) == pytest.approx(0.7)  # 1 - 3/10
    assert score("length", {"target": 4, "unit": "chars"}, "  abcdef \n") == 0.5  # 6 chars stripped: 1 - 2/4


def test_format_kinds():
    def fmt(kind, response):
        return score("format", {"kind": kind}, response)

    assert fmt("nonempty", "x") == 1.0 and fmt("nonempty", " \n ") == 0.0 and fmt("nonempty", "") == 0.0
    assert score("format", {}, "x") == 1.0  # nonempty is the default
    assert fmt("one_line", "one line\n") == 1.0 and fmt("one_line", "two\nlines") == 0.0 and fmt("one_line", "") == 0.0
    for number in ("7", " -3.5 ", ".5", "+12", "1,000", "7.0"):
        assert fmt("number", number) == 1.0, number
    for text in ("7 apples", "1e5", "", "7.", "nan", "1,00"):
        assert fmt("number", text) == 0.0, text
    assert fmt("json", '{"a": [1, 2]}') == 1.0 and fmt("json", "3") == 1.0 and fmt("json", "{a: 1}") == 0.0
    assert fmt("json", "") == 0.0


def test_exact_match_normalises_and_compares_numbers():
    row = {"answer": "7"}
    assert score("exact_match", {}, "7.0", row) == 1.0  # numbers compare as numbers
    assert score("exact_match", {}, " 7. ", row) == 1.0  # trailing '.' and whitespace dropped
    assert score("exact_match", {"normalize": False}, "7.0", row) == 0.0
    assert score("exact_match", {}, "  Paris\n", {"answer": "paris."}) == 1.0
    assert score("exact_match", {}, "new   york", {"answer": "New York"}) == 1.0
    assert score("exact_match", {}, "", row) == 0.0
    assert score("exact_match", {}, "1000", {"answer": "1,000"}) == 1.0
    assert score("exact_match", {}, "12", {"answer": 12}) == 1.0  # a non-string column
    last = {"extract": "last_number"}
    assert score("exact_match", last, "3 apples and 4 pears make 7.", row) == 1.0
    assert score("exact_match", last, "3 + 4 = 8", row) == 0.0
    assert score("exact_match", last, "no number here", row) == 0.0
    assert score("exact_match", last, "-2.50 in total", {"answer": "-2.5"}) == 1.0
    boxed = {"extract": "regex", "pattern": r"\\boxed\{([^}]*)\}", "field": "solution"}
    assert score("exact_match", boxed, r"so \boxed{7.0} it is", {"solution": "7"}) == 1.0
    assert score("exact_match", boxed, "7", {"solution": "7"}) == 0.0  # nothing extracted
    assert score("exact_match", {"extract": "regex", "pattern": r"\d+"}, "it is 7", row) == 1.0  # no group: whole match


def test_exact_match_without_the_field_names_it_and_the_rows_fields():
    rule = make_rule("exact_match", {"field": "gold"}, "em")
    with pytest.raises(ValueError, match=r"field 'gold' is missing in this prompt row \(its fields: answer, id\)"):
        rule("p", "7", {"id": 1, "answer": "7"})
    with pytest.raises(ValueError, match="field 'gold' is null"):
        rule("p", "7", {"gold": None})


def test_config_errors_name_the_source_the_kwarg_and_the_valid_ones():
    cases = [
        (
            "regex",
            {"patern": "x"},
            "reward source 'src' (type regex): unknown kwarg 'patern'; valid: pattern, full_match, ignore_case",
        ),
        ("regex", {}, "reward source 'src' (type regex): missing required kwarg 'pattern'"),
        ("regex", {"pattern": "(unclosed"}, "kwargs.pattern '(unclosed' is not a valid regular expression"),
        ("regex", {"pattern": "x", "ignore_case": "false"}, "kwargs.ignore_case must be true or false"),
        ("keyword", {"keywords": "cat"}, "kwargs.keywords must be a non-empty list"),
        ("keyword", {"keywords": []}, "kwargs.keywords must be a non-empty list"),
        ("keyword", {"keywords": ["a"], "mode": "most"}, "kwargs.mode must be one of any, all, fraction, got 'most'"),
        ("length", {"target": 0}, "kwargs.target must be a number > 0, got 0"),
        ("length", {"target": 5, "tolerance": -1}, "kwargs.tolerance must be a number >= 0"),
        ("length", {"target": 5, "unit": "tokens"}, "kwargs.unit must be one of words, chars"),
        ("format", {"kind": "xml"}, "kwargs.kind must be one of nonempty, one_line, number, json"),
        ("exact_match", {"extract": "regex"}, "kwargs.pattern is required with extract: regex"),
        ("exact_match", {"pattern": "x"}, "kwargs.pattern is only used with extract: regex"),
    ]
    for rule_type, kwargs, message in cases:
        with pytest.raises(ConfigError) as caught:
            make_rule(rule_type, kwargs, "src")
        assert message in str(caught.value), (rule_type, kwargs, str(caught.value))
        assert str(caught.value).startswith(f"reward source 'src' (type {rule_type}): ")


def test_unknown_rule_type_lists_the_valid_ones():
    with pytest.raises(ConfigError) as caught:
        make_rule("regexp", {}, "fmt")
    assert str(caught.value) == (
        "reward source 'fmt': unknown rule type 'regexp'; valid: keyword, regex, length, format, exact_match, gym"
    )


def test_rules_table_matches_the_config_rule_types():
    from rlflow.engine.config.methods import RULE_TYPES

    assert tuple(RULES) == RULE_TYPES
