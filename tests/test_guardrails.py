"""Guard rails: compilation, validation, matching and the exact block messages."""

import pytest

from gatewayd.guardrails import RuleError, RuleSet, normalize_sql, validate_guardrail
from gatewayd.models import GuardRail


def rails(input_rules=(), output_rules=(), name="g"):
    return RuleSet([GuardRail(id="1", org_id="o", name=name, input={"rules": list(input_rules)},
                              output={"rules": list(output_rules)})])


DENY = {"type": "deny_words_list", "words": ["drop table", "truncate"]}
PATTERN = {"type": "pattern_match", "pattern_regex": r"\d{3}-\d{2}-\d{4}"}


def test_deny_words_are_case_insensitive_and_sql_normalized():
    rules = rails([DENY])
    assert rules.check_input("select 1", sql=True).allowed
    for attempt in ("DROP TABLE users", "drop   table users", "DROP /* sneaky */ TABLE users",
                    "drop -- comment\n table users", "Drop\tTable users"):
        verdict = rules.check_input(attempt, sql=True)
        assert not verdict.allowed, attempt
        assert verdict.message == ("validation error, match guard rails input rule, type=deny_words_list, "
                                   "words=[drop table]")
    assert rules.check_input("TRUNCATE x").message.endswith("words=[truncate]")


def test_shell_input_keeps_double_dashes():
    rules = rails([{"type": "deny_words_list", "words": ["rm -rf"]}])
    assert not rules.check_input("rm   -rf /").allowed
    assert rails([{"type": "deny_words_list", "words": ["--all"]}]).check_input("ls --all").allowed is False


def test_pattern_match_on_output_with_exact_message():
    rules = rails(output_rules=[PATTERN])
    assert rules.check_input("123-45-6789").allowed  # input side has no rules
    verdict = rules.check_output("name\tssn\nbob\t123-45-6789")
    assert not verdict.allowed and verdict.direction == "output"
    assert verdict.message == r"validation error, match guard rails output rule, type=pattern_match, pattern=\d{3}-\d{2}-\d{4}"


def test_rule_message_overrides_default_and_every_rail_counts():
    custom = {"type": "deny_words_list", "words": ["secret"], "message": "no secrets here"}
    rules = RuleSet([
        GuardRail(id="1", org_id="o", name="a", input={"rules": [DENY]}),
        GuardRail(id="2", org_id="o", name="b", input={"rules": [custom]}),
    ])
    assert rules.check_input("show secret").message == "no secrets here"
    assert rules.check_input("show secret").guardrail == "b"
    assert not rules.check_input("drop table x").allowed


@pytest.mark.parametrize("side, error", [
    ({"rules": [{"type": "pattern_match", "pattern_regex": "(unclosed"}]}, "invalid regular expression"),
    ({"rules": [{"type": "deny_words_list", "words": []}]}, "words"),
    ({"rules": [{"type": "deny_words_list", "words": ["ok", ""]}]}, "words"),
    ({"rules": [{"type": "mystery"}]}, "must be one of"),
    ({"rules": "nope"}, "expected an array"),
])
def test_invalid_rules_are_rejected_at_definition_time(side, error):
    with pytest.raises(RuleError, match=error):
        validate_guardrail(side, {"rules": []})


def test_words_are_literal_not_regex():
    rules = rails([{"type": "deny_words_list", "words": ["a.b"]}])
    assert rules.check_input("axb").allowed
    assert not rules.check_input("A.B").allowed


def test_normalize_sql():
    assert normalize_sql("SELECT  /* x */ 1 -- tail\n FROM\tt") == "SELECT 1 FROM t"
