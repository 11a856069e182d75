"""Statement-kind rules (statement_kinds, require_where) on pglast's parse tree, and per-statement deny words."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gatewayd.guardrails import RuleError, RuleSet, validate_guardrail
from gatewayd.languages import SHELL_COMMANDS
from gatewayd.sql.pg_statements import parse_statements
from gatewayd.models import GuardRail
from gatewayd.sql.postgresql import POSTGRESQL


def rules(*rules: dict) -> RuleSet:
    return RuleSet([GuardRail(id="g1", org_id="o", name="rail", input={"rules": list(rules)})], language=POSTGRESQL)


WHERE = {"type": "require_where", "statements": ["delete", "update"]}
KINDS = {"type": "statement_kinds", "deny": ["DropStmt", "TruncateStmt", "GrantStmt"]}

UNQUALIFIED = [
    "DELETE FROM t",
    "delete from t;",
    "DeLeTe FrOm ONLY t",
    'delete from "T" as x',
    "delete from public.t t2 returning *",
    "with gone as (delete from t returning *) select * from gone",
    "with x as (select 1) delete from t",
    "select 1; delete from t; select 2",
    "explain analyze delete from t",
    "explain (analyze, buffers) update t set a = 1",
    "prepare p as delete from t",
    "update only t set a = a + 1",
    "update t set a = 1 from u",
    "delete /* where */ from t -- where a = 1",
    "delete from t using u",
    "do $$ begin delete from t; end $$",
    "do $x$ begin update t set a = 1; end $x$ language plpgsql",
    "create function f() returns void language sql as $$ delete from t $$",
    "create function f() returns void language plpgsql as $$ begin delete from t; end $$",
    "create function f() returns void language sql begin atomic delete from t; end",
    "create procedure p() language sql as 'delete from t'",
]

QUALIFIED = [
    "delete from t where a = 1",
    "DELETE FROM t WHERE true",
    "update t set a = 1 where id = $1",
    "select 'delete from t'",
    "select * from t",
    "insert into t values (1)",
    "with gone as (delete from t where a = 1 returning *) select * from gone",
    "delete from t where current_of_like = 1",
    "do $$ begin delete from t where a = 1; end $$",
    "-- delete from t\nselect 1",
]


@pytest.mark.parametrize("sql", UNQUALIFIED)
def test_require_where_blocks_every_spelling(sql: str) -> None:
    verdict = rules(WHERE).check_input(sql)
    assert not verdict.allowed
    assert "without WHERE" in verdict.message and verdict.rule_type == "require_where"


@pytest.mark.parametrize("sql", QUALIFIED)
def test_require_where_lets_qualified_statements_through(sql: str) -> None:
    assert rules(WHERE).check_input(sql).allowed


@pytest.mark.parametrize("sql", [
    "drop table t", "DROP TABLE IF EXISTS a, b CASCADE", "truncate t", "truncate table only t",
    "grant all on t to public", "select 1; drop/**/table t", "explain select 1; truncate t",
    "do $$ begin truncate t; end $$", "prepare q as select 1; drop index i",
])
def test_statement_kinds_denied(sql: str) -> None:
    verdict = rules(KINDS).check_input(sql)
    assert not verdict.allowed and "statement=" in verdict.message


@pytest.mark.parametrize("sql", ["select 'drop table t'", "create table t (a int)", "delete from t where a = 1",
                                 "select $$truncate t$$", 'select 1 as "drop"'])
def test_statement_kinds_allowed(sql: str) -> None:
    assert rules(KINDS).check_input(sql).allowed


def test_multi_statement_names_the_statement() -> None:
    verdict = rules(WHERE).check_input("select 1; select 2; delete from t")
    assert "(statement 3 of 3)" in verdict.message
    verdict = rules({"type": "deny_words_list", "words": ["drop table"]}).check_input(
        "select 1; drop table t; select 3")
    assert not verdict.allowed and "(statement 2 of 3)" in verdict.message
    verdict = rules({"type": "pattern_match", "pattern_regex": "(?i)truncate"}).check_input(
        "select 1; truncate t")
    assert not verdict.allowed and verdict.message.endswith("(statement 2 of 2)")
    single = rules({"type": "deny_words_list", "words": ["drop table"]}).check_input("drop table t")
    assert "statement" not in single.message.split("words=")[1]


def test_unparsable_sql_fails_closed() -> None:
    verdict = rules(WHERE).check_input("delete frm t")
    assert not verdict.allowed and "unparsable" in verdict.message


def test_statement_rules_on_a_language_that_is_not_sql_refuse_everything() -> None:
    """Never a silent fallback: a stored statement rule on a shell connection (the API refuses to attach one, 422)
    cannot be applied, so its side refuses everything and says why; its deny words beside it still read shell."""
    shell = RuleSet([GuardRail(id="g1", org_id="o", name="rail", input={"rules": [WHERE]})], language=SHELL_COMMANDS)
    verdict = shell.check_input("ls")
    assert not verdict.allowed and "require_where reads SQL statements" in verdict.message
    assert "shell commands" in verdict.message and "cannot be applied" in verdict.message
    words = RuleSet([GuardRail(id="g2", org_id="o", name="words", input={"rules": [
        {"type": "deny_words_list", "words": ["--all"]}]})], language=SHELL_COMMANDS)
    assert not words.check_input("ls --all").allowed  # ``--`` is no comment in a shell


def test_spec_rule_types_unchanged_beside_statement_rules() -> None:
    mixed = rules(KINDS, {"type": "deny_words_list", "words": ["pg_sleep"]})
    assert not mixed.check_input("select pg_sleep(1)").allowed
    assert mixed.check_input("select 1").allowed


def test_custom_message() -> None:
    verdict = rules({**WHERE, "message": "add a WHERE"}).check_input("delete from t")
    assert verdict.message == "add a WHERE"


def test_parse_cache_by_text() -> None:
    first = parse_statements("delete from cached_t")
    assert parse_statements("delete from cached_t") is first


@pytest.mark.parametrize("rule, says", [
    ({"type": "statement_kinds", "deny": ["DropTable"]}, "pglast"),
    ({"type": "statement_kinds", "deny": []}, "non-empty"),
    ({"type": "require_where", "statements": ["insert"]}, "delete, update"),
    ({"type": "require_where"}, "non-empty"),
])
def test_validation(rule: dict, says: str) -> None:
    with pytest.raises(RuleError, match=says):
        validate_guardrail({"rules": [rule]}, {"rules": []})


def test_statement_rules_are_input_rules() -> None:
    with pytest.raises(RuleError, match="input rule"):
        validate_guardrail({"rules": []}, {"rules": [WHERE]})
    validate_guardrail({"rules": [WHERE, KINDS]}, {"rules": []})


def test_long_statements_are_parsed_too() -> None:
    values = ", ".join(f"({i}, 'row {i}')" for i in range(8000))  # well over the 4 KiB cache and 64 KiB scan limits
    assert len(values) > 64 * 1024
    assert rules(WHERE, KINDS).check_input(f"insert into t values {values}").allowed
    assert not rules(WHERE).check_input(f"insert into t values {values}; delete from t").allowed


@pytest.mark.parametrize("sql", [
    "update t set a = (select 1 from u where u.id = 2)",
    "delete from t where false; delete from t",
    "update t set a = 1 from (select * from u where b) s",
    "delete from t where a in (select 1); update u set b = 1",
    "update t set a = exists (select 1 where true)",
])
def test_a_where_elsewhere_is_not_the_statements_own(sql: str) -> None:
    assert not rules(WHERE).check_input(sql).allowed


def test_statement_shape_by_json_matches_the_full_walk() -> None:
    import json

    from pglast import parser as pg

    from gatewayd.sql import pg_statements as statements

    for sql in UNQUALIFIED + QUALIFIED + ["update t set a = (select 1 from u where u.id = 2)", "truncate t",
                                          "drop owned by current_user", "select 1",
                                          "insert into t values (1) on conflict (id) do update set a = 0",
                                          "insert into t values (1) on conflict do nothing"]:
        tree_json = pg.parse_sql_json(sql)
        fast = statements._fast(tree_json)
        found = statements.FoundNodes()
        for raw in json.loads(tree_json)["stmts"]:
            statements._walk(raw["stmt"], found, sql, 0)
        if fast is not None:
            assert fast == found.statement(), sql


def mysql_rules(*rules: dict) -> RuleSet:
    from gatewayd.sql.mysql import MYSQL

    return RuleSet([GuardRail(id="g1", org_id="o", name="rail", input={"rules": list(rules)})], language=MYSQL)


@pytest.mark.parametrize("sql, says", [
    ("CREATE OR REPLACE TABLE t (id INT)", "statement=CREATE OR REPLACE TABLE (it has the effect of DropStmt)"),
    ("CREATE OR REPLACE TABLE t AS SELECT 1 AS id", "statement=CREATE OR REPLACE TABLE"),
    ("create or replace temporary table t select 1", "statement=CREATE OR REPLACE TABLE"),
    ("CREATE OR REPLACE USER u", "statement=CREATE OR REPLACE USER (it has the effect of DropStmt)"),
])
def test_mysql_create_or_replace_drops_what_there_is(sql: str, says: str) -> None:
    """MariaDB drops the table (its rows) or the user there is before it creates the new one."""
    verdict = mysql_rules({"type": "statement_kinds", "deny": ["DropStmt"]}).check_input(sql)
    assert not verdict.allowed and says in verdict.message, verdict.message


@pytest.mark.parametrize("sql", ["CREATE TABLE t (id INT)", "CREATE TABLE IF NOT EXISTS t AS SELECT 1 AS id",
                                 "CREATE OR REPLACE VIEW v AS SELECT 1", "CREATE USER u"])
def test_mysql_create_without_a_drop_passes(sql: str) -> None:
    assert mysql_rules({"type": "statement_kinds", "deny": ["DropStmt"]}).check_input(sql).allowed


UPDATES = {"type": "statement_kinds", "deny": ["UpdateStmt"]}


def refused_twice(rules_of: Callable[..., RuleSet], sql: str, says: str, says_where: str, kinds: dict = UPDATES) -> None:
    """``sql`` is refused by a rule denying the kind it has the effect of and by ``require_where``, each saying
    why (``rules_of``: ``rules`` or ``mysql_rules``)."""
    verdict = rules_of(kinds).check_input(sql)
    assert not verdict.allowed and says in verdict.message, verdict.message
    verdict = rules_of(WHERE).check_input(sql)
    assert not verdict.allowed and says_where in verdict.message, verdict.message


UPSERTS = [
    "insert into t select * from t on conflict (id) do update set a = 0",
    "with u as (insert into t values (1) on conflict (id) do update set a = 0 returning *) select * from u",
    "do $$ begin insert into t values (1) on conflict on constraint t_pkey do update set a = excluded.a; end $$",
]


@pytest.mark.parametrize("sql", UPSERTS)
def test_on_conflict_do_update_is_an_update_without_where(sql: str) -> None:
    """It updates every row it meets (``INSERT ... SELECT`` meets them all), like a MERGE's ``THEN UPDATE``."""
    refused_twice(rules, sql, "statement=InsertStmt ON CONFLICT DO UPDATE (it has the effect of UpdateStmt)",
                  "update without WHERE (InsertStmt ON CONFLICT DO UPDATE)")


def test_on_conflict_do_update_with_its_where_and_do_nothing() -> None:
    qualified = "insert into t values (1) on conflict (id) do update set a = 0 where t.a > 1"
    assert rules(WHERE).check_input(qualified).allowed
    assert not rules(UPDATES).check_input(qualified).allowed  # still an update
    for sql in ("insert into t values (1) on conflict do nothing", "insert into t select * from t on conflict (id) "
                "do nothing", "insert into t values ('on conflict do update')"):
        assert rules(UPDATES, WHERE).check_input(sql).allowed, sql


@pytest.mark.parametrize("sql, says", [
    ("INSERT INTO t SELECT id, a FROM t ON DUPLICATE KEY UPDATE a = 0",
     ["statement=INSERT ON DUPLICATE KEY UPDATE (it has the effect of UpdateStmt)",
      "update without WHERE (INSERT ON DUPLICATE KEY UPDATE)"]),
    ("INSERT INTO t VALUES (1, 2) AS new ON DUPLICATE KEY UPDATE a = new.a",
     ["statement=INSERT ON DUPLICATE KEY UPDATE", "update without WHERE (INSERT ON DUPLICATE KEY UPDATE)"]),
    ("PREPARE s FROM 'INSERT INTO t SET id = 1 ON DUPLICATE KEY UPDATE a = 0'",
     ["statement=INSERT ON DUPLICATE KEY UPDATE", "update without WHERE (INSERT ON DUPLICATE KEY UPDATE)"]),
    ("REPLACE INTO t (id) SELECT id FROM t",
     ["statement=REPLACE (it has the effect of DeleteStmt)", "delete without WHERE (REPLACE)"]),
])
def test_mysql_upserts_update_or_delete_every_row_they_meet(sql: str, says: list[str]) -> None:
    kind, where = says
    refused_twice(mysql_rules, sql, kind, where, {"type": "statement_kinds", "deny": ["UpdateStmt", "DeleteStmt"]})


def test_mysql_a_plain_insert_passes() -> None:
    for sql in ("INSERT INTO t VALUES (1, 2)", "INSERT IGNORE INTO t SELECT id, a FROM u"):
        assert mysql_rules({"type": "statement_kinds", "deny": ["UpdateStmt", "DeleteStmt"]}, WHERE
                           ).check_input(sql).allowed, sql


@pytest.mark.parametrize("sql", ["alter table t alter column a type int using 0",
                                 "ALTER TABLE ONLY t ALTER a SET DATA TYPE text USING 'x', ADD COLUMN b int"])
def test_a_column_type_changed_using_an_expression_is_an_update_without_where(sql: str) -> None:
    """``USING`` writes every row's value anew: the effect of an UPDATE of the whole table."""
    refused_twice(rules, sql, "statement=AlterTableStmt ALTER COLUMN TYPE USING (it has the effect of UpdateStmt)",
                  "update without WHERE (AlterTableStmt ALTER COLUMN TYPE USING)")


@pytest.mark.parametrize("sql", ["alter table t alter column a type bigint", "alter table t alter a set default 0",
                                 "alter table t add column b int default 0"])
def test_a_column_type_changed_by_its_cast_passes(sql: str) -> None:
    assert rules(UPDATES, WHERE).check_input(sql).allowed


@pytest.mark.parametrize("sql", ["ALTER TABLE t MODIFY a INT GENERATED ALWAYS AS (0) VIRTUAL",
                                 "ALTER TABLE t CHANGE a a INT AS (0) STORED"])
def test_mysql_a_column_made_generated_is_an_update_without_where(sql: str) -> None:
    """MariaDB drops a column's stored values for what its new expression computes: every row rewritten."""
    refused_twice(mysql_rules, sql, "(it has the effect of UpdateStmt)",
                  "update without WHERE (AlterTableStmt MODIFY COLUMN")


@pytest.mark.parametrize("sql", ["ALTER TABLE t MODIFY a BIGINT", "ALTER TABLE t ADD COLUMN b INT AS (a + 1)",
                                 "ALTER TABLE t CHANGE a b INT"])
def test_mysql_a_column_retyped_or_a_generated_one_added_passes(sql: str) -> None:
    assert mysql_rules(UPDATES, WHERE).check_input(sql).allowed
