"""Guard rails: compilation, validation, matching and the exact block messages."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.guardrails import AUDIT_INPUT_CHARS, RuleError, RuleSet, validate_guardrail
from gatewayd.languages import SHELL_COMMANDS, TEXT
from gatewayd.models import GuardRail
from gatewayd.sql.pg_scan import normalize_sql
from gatewayd.sql.postgresql import POSTGRESQL


def rails(input_rules=(), output_rules=(), name="g", language=POSTGRESQL):
    return RuleSet([GuardRail(id="1", org_id="o", name=name, input={"rules": list(input_rules)},
                              output={"rules": list(output_rules)})], language=language)


DENY = {"type": "deny_words_list", "words": ["drop table", "truncate"]}
PATTERN = {"type": "pattern_match", "pattern_regex": r"\d{3}-\d{2}-\d{4}"}


def test_deny_words_are_case_insensitive_and_sql_normalized():
    rules = rails([DENY])
    assert rules.check_input("select 1").allowed
    for attempt in ("DROP TABLE users", "drop   table users", "DROP /* sneaky */ TABLE users",
                    "drop -- comment\n table users", "Drop\tTable users"):
        verdict = rules.check_input(attempt)
        assert not verdict.allowed, attempt
        assert verdict.message == ("validation error, match guard rails input rule, type=deny_words_list, "
                                   "words=[drop table]")
    assert rules.check_input("TRUNCATE x").message.endswith("words=[truncate]")


def test_shell_input_keeps_double_dashes():
    rules = rails([{"type": "deny_words_list", "words": ["rm -rf"]}], language=SHELL_COMMANDS)
    assert not rules.check_input("rm   -rf /").allowed
    assert rails([{"type": "deny_words_list", "words": ["--all"]}],
                 language=SHELL_COMMANDS).check_input("ls --all").allowed is False


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



# --------------------------------------------------------------------------- SQL read as PostgreSQL reads it

DROP = {"type": "deny_words_list", "words": ["drop table"]}


@pytest.mark.parametrize("attempt", [
    # the four bypasses of issue 13: a comment marker inside a literal or quoted identifier
    "select '/*'; drop/**/table t; select '*/'",
    "select '--' as c; drop/**/table t",
    "select $$/*$$; drop/**/table t",
    "select 1 as \"--\"; drop/**/table t",
    # the same with every other quoting form PostgreSQL has
    "select 'it''s /*'; drop/**/table t; select '*/'",
    "select E'\\'/*'; drop/**/table t; select '*/'",
    "select $tag$ $$ /* $tag$; drop/**/table t; select '*/'",
    "select U&'\\0027/*'; drop/**/table t; select '*/'",
    "select U&\"/*\"; drop/**/table t; select '*/'",
    "select \"a\"\"/*\"; drop/**/table t; select '*/'",
    "select 'a' /* outer /* nested */ still a comment */; drop/* x /* y */ z */table t",
    "select 1 -- '\ndrop table t",
    # words hidden in a literal's escapes: a string that may become SQL (EXECUTE, DO)
    "select E'drop\\x20table t'",
    "select E'drop\\040table t'",
    "select E'drop\\u0020table t'",
    "select U&'drop\\0020table t'",
    "select U&'drop!0020table t' UESCAPE '!'",
    "select U&'drop\\+000020table t'",
    "do $f$ begin execute 'drop/**/table t'; end $f$",
    "select 'drop' 'x'; drop\n--comment\ntable t",
    "DROP TABLE t",
    "select 1 as \"DROP TABLE\"",  # a quoted identifier compares by its value
])
def test_deny_words_see_sql_as_postgresql_does(attempt):
    verdict = rails([DROP]).check_input(attempt)
    assert not verdict.allowed, attempt
    # a query of several statements names the one blocked: "... words=[drop table] (statement 2 of 3)"
    assert re.search(r"words=\[drop table\]( \(statement \d of \d\))?$", verdict.message) and verdict.text == attempt


@pytest.mark.parametrize("attempt", [
    "select 'a\\''; drop/**/table t; --'",  # standard_conforming_strings=off reads this differently
    "select 'unterminated; drop/**/table t",
    "select $a$ unterminated; drop/* */table t",
    "select /* unterminated drop table",
    "select \"unterminated; drop\n-- x\ntable t",
])
def test_text_the_scanner_refuses_is_still_matched(attempt):
    assert not rails([DROP]).check_input(attempt).allowed, attempt


def test_what_the_scanner_cannot_take_falls_back_instead_of_failing():
    rules = rails([DROP])
    assert not rules.check_input("select '\udcff', 'drop/**/table'").allowed  # a lone surrogate
    assert normalize_sql("select '\udcff' -- x") == "select '\udcff' -- x"
    assert not rules.check_input("select E'a\\x00'' drop/**/table t; --'").allowed
    assert normalize_sql("select 'a\x00b' /* c */, 1") == "select a b , 1"  # a NUL does not end the text early


@pytest.mark.parametrize("statement", [
    "select 1", "select 'drop', 'table'", "select droptable from t", "select 1 -- drop\n, 2 as \"table\"",
    "UPDATE pgbench_accounts SET abalance = abalance + -4410 WHERE aid = 51234;",
])
def test_harmless_sql_is_allowed(statement):
    assert rails([DROP]).check_input(statement).allowed, statement


@pytest.mark.parametrize("text, expected", [
    ("SELECT  /* x */ 1 -- tail\n FROM\tt", "SELECT 1 FROM t"),
    ("select 'it''s'", "select it's"),
    ("select 'a'\n  'b'", "select ab"),  # a literal continued on the next line
    ("select E'a\\'b\\\\c\\n'", "select a'b\\c"),
    ("select E'\\x41\\101\\u0041\\U00000041'", "select AAAA"),
    ("select 'back\\slash'", "select back\\slash"),  # standard_conforming_strings: a backslash is a backslash
    ("select $$ x $$, $t$ $$ y $t$", "select x , $$ y"),
    ("select U&'d\\0061t\\+000061'", "select data"),
    ("select U&'d!0061t' UESCAPE '!'", "select dat"),
    ("select U&'\\D83D\\DE00'", "select \U0001F600"),  # a surrogate pair
    ("select \"Quoted\"\"Name\", U&\"d\\0061t\"", 'select Quoted"Name, dat'),
    ("select 1 /* a /* b */ c */ + 2", "select 1 + 2"),
    ("select pg_sleep(1)", "select pg_sleep(1)"),
    ("select 'x''--' , '/* y */z'", "select x'-- , z"),
    ("select 'é' || \"ü\"", "select é || ü"),  # offsets are characters, not bytes
])
def test_normalize_sql(text, expected):
    assert normalize_sql(text) == expected


def test_ssh_and_http_text_is_not_read_as_sql():
    rules = rails([{"type": "deny_words_list", "words": ["rm -rf"]}], language=SHELL_COMMANDS)
    assert not rules.check_input("echo '--'; rm   -rf /").allowed
    assert rails([DROP], language=SHELL_COMMANDS).check_input("echo drop/**/table").allowed  # no SQL comments
    assert not rails([DROP]).check_input("echo drop/**/table").allowed  # PostgreSQL's input: a comment


# the spellings that ran ``touch`` past a deny word through a real gateway (the last for a rule on "touch x")
BASH_SPELLINGS = ["bash -c $'tou\\x63h x'", "'to''uch' x", 'to"uch" x', "tou\\ch x", "$'\\x74ouch' x",
                  "touch${IFS}x", "touch$IFS'x'", "touch${IFS:0:1}x", "$'\\164\\u006fuch' x", 'tou""ch x',
                  "tou\\\nch x", 'bash -c "to\'u\'ch x"', 'sh -c "bash -c \\$\'tou\\\\x63h x\'"',
                  "tou$@ch x", 'to"u${1}"ch x', "touc$*h${IFS}x"]


@pytest.mark.parametrize("spelling", BASH_SPELLINGS)
def test_shell_input_is_read_as_bash_reads_its_words(spelling):
    """A deny word spelled with quotes, escapes, ``$'...'`` or ``$IFS`` is blocked on the word bash runs; the
    verdict quotes the line as typed."""
    rules = rails([{"type": "deny_words_list", "words": ["touch x"]}], language=SHELL_COMMANDS)
    verdict = rules.check_input(spelling)
    assert not verdict.allowed, spelling
    assert verdict.text == spelling and verdict.message.endswith("words=[touch x]")
    assert not rails([{"type": "pattern_match", "pattern_regex": r"^\s*(bash -c |sh -c )*touch"}],
                     language=SHELL_COMMANDS).check_input(spelling).allowed


@pytest.mark.parametrize("line", ["ls -la \"my dir\"", "echo 'it''s'", "echo \"$HOME\" 'a b' \\; $'\\tx'",
                                  "grep -e 'to uch' f", "echo $IFSx", "echo", 'for f in "$@"; do echo $f; done'])
def test_ordinary_shell_lines_pass_their_readings(line):
    assert rails([{"type": "deny_words_list", "words": ["touch"]}], language=SHELL_COMMANDS).check_input(line).allowed


@pytest.mark.parametrize("line", BASH_SPELLINGS[1:11] + [
    "ls -la \"my dir\"", "echo 'it''s'", "a\\ b 'c d' \"e\\\"f\\$g\\x\" $'h\\ti\\x41\\101\\e\\cA\\q\\'' \"\" ''",
    "x$'\\u00e9\\xc3\\xa9'y \"${IFS}a\"$IFS'b'", "'it'\\''s' \"a'b\" 'c\"d'", "$\"tr\" \\$IFS",
    "a$@b \"c$1d\" e${2}f"])
def test_the_shell_reading_is_bashs(line):
    """The first reading is the line's words as bash itself makes them (printed by bash, one per line)."""
    import subprocess
    from gatewayd.languages import collapse
    from gatewayd.shell_words import shell_readings
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {line}"], capture_output=True, check=True,
                           env={"LC_ALL": "C.UTF-8"}).stdout.decode("utf-8", "replace").splitlines()
    assert collapse(shell_readings(line)[0]) == collapse(" ".join(words))


# --------------------------------------------------------------------------- patterns on a linear-time engine


@pytest.mark.parametrize("pattern, construct", [
    (r"(a)\1", "backreferences"), (r"(?P<x>a)(?P=x)", "backreferences"), (r"a(?=b)", "lookahead"),
    (r"a(?!b)", "lookahead"), (r"(?<=a)b", "lookbehind"), (r"(?<!a)b", "lookbehind"),
    (r"(?>a+)b", "atomic groups"), (r"a++b", "possessive quantifiers"), (r"(a)?(?(1)b|c)", "conditional groups"),
])
def test_patterns_re2_cannot_run_are_refused_with_the_construct_named(pattern, construct):
    with pytest.raises(RuleError, match=rf"pattern_regex: {construct} not supported.*linear-time"):
        validate_guardrail({"rules": [{"type": "pattern_match", "pattern_regex": pattern}]}, {"rules": []})


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a|aa)+$", r"(a|a?)+$", r"(\w+\s?)+$", r"(.*a){20}",
                                     r"^(([a-z])+.)+[A-Z]([a-z])+$"])
def test_catastrophic_patterns_run_in_linear_time(pattern):
    rules = rails([{"type": "pattern_match", "pattern_regex": pattern}],
                  [{"type": "pattern_match", "pattern_regex": pattern}])
    evil = "a" * 5000 + "!"  # hours with a backtracking engine
    assert rules.check_input(evil).allowed in (True, False)
    assert rules.check_output(evil).allowed in (True, False)


def test_a_stored_pattern_that_no_longer_compiles_refuses_everything():
    rail = GuardRail(id="1", org_id="o", name="old", input={"rules": [{"type": "pattern_match",
                                                                       "pattern_regex": r"(a)\1"}]})
    verdict = RuleSet([rail], language=POSTGRESQL).check_input("select 1")
    assert not verdict.allowed and "guard rail 'old' cannot be applied" in verdict.message
    assert RuleSet([rail]).check_output("anything").allowed


def test_an_input_block_keeps_what_was_blocked_and_an_output_block_does_not():
    rules = rails([DROP], [PATTERN])
    long = "drop table t; " + "x" * 10_000
    assert rules.check_input(long).text == long[:AUDIT_INPUT_CHARS]
    assert rules.check_output("123-45-6789").text == ""


_SQL_BITS = st.sampled_from(["'", '"', "$$", "$t$", "--", "/*", "*/", "\n", " ", "E'", "U&'", "\\", "''", "x", ";"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(_SQL_BITS, st.text(max_size=4)), max_size=20).map("".join))
def test_whatever_comes_before_a_deny_word_cannot_hide_it(prefix):
    verdict = rails([DROP]).check_input(prefix + " drop/* x */table t")  # never raises either
    assert not verdict.allowed


_SEVERAL = [{"type": "deny_words_list", "words": ["drop table", "truncate"]},
            {"type": "pattern_match", "pattern_regex": "SECRET"},
            {"type": "pattern_match", "pattern_regex": "^select 1$"},
            {"type": "pattern_match", "pattern_regex": "(?i)delete\\s+from\\s+\\w+\\s*;"},
            {"type": "pattern_match", "pattern_regex": "\\Qa|b\\E"}]


@pytest.mark.parametrize("text", ["DROP   TABLE t", "drop/**/table t", "secret", "SECRET", "select 1", "xselect 1",
                                  "DELETE FROM t;", "a|b", "a", "b", "select 'drop table'", "--x\ntruncate t",
                                  "select $$SECRET$$", "select 2"])
@pytest.mark.parametrize("sql", [True, False])
def test_rules_searched_together_decide_as_each_rule_alone(text: str, sql: bool) -> None:
    """The rules' combined search (one RE2 call for the usual input) lets through only what no rule blocks alone."""
    def rule_set(inputs: list[dict], outputs: list[dict], together: bool = True) -> RuleSet:
        rules = RuleSet([GuardRail(id="g", org_id="o", name="all", input={"rules": inputs},
                                   output={"rules": outputs})], language=POSTGRESQL if sql else TEXT)
        if not together:  # the reference: every rule searched on its own
            rules._text_any = rules._text_any_sql = rules._output_any = None
        return rules

    verdict = rule_set(_SEVERAL, []).check_input(text)
    reference = rule_set(_SEVERAL, [], together=False).check_input(text)
    assert (verdict.allowed, verdict.message) == (reference.allowed, reference.message)
    output = rule_set([], _SEVERAL[1:]).check_output(text)
    reference = rule_set([], _SEVERAL[1:], together=False).check_output(text)
    assert (output.allowed, output.message) == (reference.allowed, reference.message)


# -- the literal look before RE2 (``RuleSet._check_sql``): ASCII SQL without any literal a rule needs passes

_LITERAL_RULES = [{"type": "deny_words_list", "words": ["drop table", "truncate"]},
                  {"type": "pattern_match", "pattern_regex": "(?i)delete\\s+from\\s+\\w+\\s*;?\\s*$"},
                  {"type": "pattern_match", "pattern_regex": "(?i)(grant|revoke)\\s+all"},
                  {"type": "pattern_match", "pattern_regex": "SECRET"},
                  {"type": "pattern_match", "pattern_regex": "^select 1$"},
                  {"type": "pattern_match", "pattern_regex": "x*yz+"}]
_TOKENS = ["select", "SELECT", "1", "from", "FROM", "t", "where", "aid", "=", "42", ";", "delete", "DeLeTe", "delet",
           "drop", "DROP", "table", "Table", "truncate", "TRUNCAT", "grant", "Revoke", "all", "ALL", "secret", "SECRET",
           "yz", "Yzz", "xyz", "  ", "\t", "\n", "x"]


@pytest.mark.parametrize(("pattern", "literals"), [
    ("(?i)delete\\s+from\\s+\\w+\\s*;", ("delete",)),
    ("(?i)(drop|truncate)\\s+table", ("table",)),
    ("(foo|b)", ("b", "foo")),
    ("(?:ab)?cde", ("cde",)),
    ("x*yz+", ("y",)),
    ("a.b", ("a",)),
    ("(a|b*)", None),  # one alternative needs nothing
    ("[[:alpha:]]bcd", None),  # a class Python and RE2 read differently: no literal is trusted
    ("a{,3}xyz", None),  # RE2: a literal "{,3}"; Python: a repeat
    ("\\Qa|b\\E", None),
    ("\\x41BC", None),
    ("(?s)abc", None),
    ("ſelect", None),
])
def test_what_a_pattern_cannot_match_without(pattern, literals):
    from gatewayd.patterns import pattern_literals as _pattern_literals
    assert _pattern_literals(pattern) == literals


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_TOKENS), max_size=12), st.sampled_from([" ", "", "  "]))
def test_the_literal_look_decides_as_re2_alone(tokens: list[str], joiner: str) -> None:
    """Text the look lets through is text no rule matches: the same verdicts as every rule searched alone."""
    text = joiner.join(tokens)
    rules = rails(_LITERAL_RULES)
    assert rules._text_literals is not None  # every rule has literals: the look is on
    reference = rails(_LITERAL_RULES)
    reference._text_literals = reference._text_any = reference._text_any_sql = None
    verdict, expected = rules.check_input(text), reference.check_input(text)
    assert (verdict.allowed, verdict.message) == (expected.allowed, expected.message), text


def test_the_literal_look_leaves_non_ascii_to_re2():
    """RE2's case folding matches ``ſ`` (long s) to ``s``: non-ASCII text, or a word with no ASCII part, is not
    judged by the look."""
    rules = rails([{"type": "deny_words_list", "words": ["select"]}])
    assert rules._text_literals == ("select",)
    assert not rules.check_input("ſelect 1").allowed
    assert not rules.check_input("SELECT 1").allowed
    assert rules.check_input("show all").allowed
    folded = rails([{"type": "deny_words_list", "words": ["ſelect"]}])
    assert folded._text_literals is None
    assert not folded.check_input("select 1").allowed


# what the guard rails' two per-statement checks look for: whitespace of every kind, controls, quotes, comment and
# dollar-quote starts, characters beyond ASCII; mixed with any text at all
READ_ALPHABET = " \t\n\r\x0b\x0c\x1c\x1f\x00\x7f\x85\xa0\u2000\u200b\u2028\u3000ab1'\"-/*$é\U0001f600"


@settings(max_examples=3000, deadline=None)
@given(st.one_of(st.text(alphabet=READ_ALPHABET, max_size=14), st.text(max_size=40)))
def test_collapse_and_needs_scan_say_what_their_definitions_say(text):
    """``collapse`` and ``needs_scan`` (compiled: one pass in C over plain ASCII text) against their definitions:
    whitespace runs as one space and none at the ends; a quote, ``--``, ``/*`` or a dollar quote. This suite runs
    compiled and from source (tests/test_hotpath.py)."""
    from gatewayd.languages import collapse
    from gatewayd.sql.pg_scan import needs_scan

    assert collapse(text) == " ".join(text.split())
    assert needs_scan(text) == (any(mark in text for mark in ("'", '"', "--", "/*"))
                                or re.search(r"\$(?![0-9])", text) is not None)


def test_collapse_gives_back_the_text_itself_when_it_has_nothing_to_collapse():
    from gatewayd.languages import collapse

    for text in ("SELECT abalance FROM pgbench_accounts WHERE aid = 1;", "", "a", "é b"):
        assert collapse(text) is text
    for text in (" a", "a ", "a  b", "a\tb", "a\x7fb", "a\u200bb", " "):
        assert collapse(text) == " ".join(text.split())
