"""What a statement names, for masking the values it computes (proxies/postgres/computed.py)."""

from __future__ import annotations

import pytest

from proxies.postgres.computed import Mentions

WATCHED = {"ssn": "last4"}


@pytest.mark.parametrize("text", [
    "select upper(ssn) from people",
    'select upper("SSN") from people',  # quoted: read by its value
    'select U&"\\0073sn" from people',  # spelled with escapes
    "select ssn::text as s from people",
    "select (select ssn from people limit 1)",
    "select row_to_json(p.*) from people p",  # a star that selects columns
    "select array_agg(x)::text from (select * from people) x",  # a star in a subquery
    "select current_setting('app.v')",  # set from data earlier
    "select current_setting(E'app\\x2ev', true)",
    "select current_setting(name) from settings_table",
    "show app.v",
    "select f('ssn')",  # a literal that may become SQL
])
def test_a_statement_naming_a_masked_column_a_star_or_a_setting_mentions_one(text: str) -> None:
    assert Mentions().read(text, WATCHED)


@pytest.mark.parametrize("text", [
    "select count(*) from people",
    "select id, name from people fetch first 3 rows only",  # no cursor's FETCH
    "select 1 + 1",
    "select ssnx, xssn from people",  # other words
    "-- ssn\nselect 1",  # a comment
    "SELECT current_setting('jit') AS cur, set_config('jit', 'off', false) AS new",  # asyncpg, for its types
    "show search_path",
    "with t as (select 1 as a) select distinct *, a::text as b from t",  # the select list's own: sources kept
])
def test_a_statement_naming_none_mentions_none(text: str) -> None:
    assert not Mentions().read(text, WATCHED)


def test_executing_or_fetching_answers_for_the_statement_that_defined_the_name() -> None:
    """``EXECUTE`` and ``FETCH`` name no column: they answer for their ``PREPARE`` / ``DECLARE``; a name never
    seen defined (a cursor a function opened) mentions one; a change of the rules forgets every answer."""
    mentions = Mentions()
    assert mentions.read("prepare a as select upper(ssn) from people", WATCHED)
    assert not mentions.read("prepare b as select count(*) from people", WATCHED)
    assert mentions.read("execute a", WATCHED) and not mentions.read("execute b(1)", WATCHED)
    assert mentions.read("execute never_prepared", WATCHED)
    assert not mentions.read("begin; declare c no scroll cursor for select 1; fetch forward 10 from c", WATCHED)
    assert not mentions.read("move 2 in c", WATCHED)
    assert mentions.read('fetch all from "opened_by_a_function"', WATCHED)
    mentions.parsed("s1", "select count(*) from people", WATCHED)
    assert not mentions.statement("s1") and mentions.statement("never_parsed") and mentions.statement(None)
    assert not mentions.read("select 1", {"email": "fixed"})  # the rules changed
    assert mentions.statement("s1") and mentions.read("execute b", {"email": "fixed"})


def test_a_query_of_the_catalog_alone_computes_nothing_from_a_masked_column() -> None:
    """A driver's own queries name ``name`` or ``kind`` (asyncpg's type introspection): they read the catalog
    only, and their computed columns must pass (asyncpg failed on any enum or composite type under a rule on
    ``name``). A table of the database's, a function in FROM, or a table of the catalog's that holds data or
    statements a session wrote (statistics' sample values, settings) make a query not one of the catalog."""
    import asyncpg.introspection as introspection

    watched = {"name": "fixed", "kind": "fixed"}
    for query in (introspection.INTRO_LOOKUP_TYPES_13, introspection.TYPE_BY_NAME, introspection._TYPEINFO_13,
                  "select c.relname::text as name from pg_catalog.pg_class c",
                  "select upper(table_name) as name from information_schema.columns"):
        assert not Mentions().read(query, watched), query[:80]
    for query in ("select upper(name) from pg_class, people",
                  "select upper(name) from pg_people",  # not the catalog's: a table of the database's
                  "select most_common_vals::text as name from pg_stats",
                  "select setting || '' as name from pg_settings",
                  "select upper(name) from pg_catalog.pg_class, generate_series(1, 2)",
                  "with people as (select name from public.people) select upper(name) from people"):
        assert Mentions().read(query, watched), query
