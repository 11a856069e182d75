"""What a statement names, for masking the values it computes (proxies/postgres/computed.py), with what a real
PostgreSQL's catalog says is built in (proxies/postgres/catalog.py) and of real views."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from gatewayd.dialer import DirectDialer
from proxies.postgres.catalog import Catalog, read_catalog
from proxies.postgres.computed import BuiltIns, Mentions
from proxies.postgres.upstream import TargetSettings

WATCHED = {"ssn": "last4"}
# what the database defines: a function that reads a masked column, an operator and a cast that run one, views
DATABASE = """
create extension hstore;
create table people (id int primary key, name text, ssn text);
create table orders (id int, person int, total int);
create function get_ssn(i int) returns text language sql as $$ select ssn from people where id = i $$;
create function ssn_of(i int) returns text language sql as $$ select ssn from people where id = i $$;
create operator ### (rightarg = int, function = ssn_of);
create type held as (v text);
create function held_of(i int) returns held language sql as $$ select row(ssn)::held from people where id = i $$;
create cast (int as held) with function held_of(int);
create view plain as select p.id, p.name, p.ssn as tax_id from people p;
create view joined as select o.id, o.total, p.name as who, upper(p.name) as loud from orders o join people p
  on p.id = o.person;
create view computed as select id, ssn || '' as s, upper(name) as n from people;
create view unioned as select id, ssn as x from people union all select id, 'none' from orders;
create view nested as select plain.id as i, plain.tax_id as t, plain.name as nm from plain;
create view rows as select row_to_json(p) as j, p.id from people p;
create materialized view copied as select id, ssn as kept from people;
create view other as select id, total from orders;
"""


@pytest.fixture(scope="module")
def catalog(pg_target: Any) -> tuple[Catalog, dict[tuple[int, int], tuple[str, str]]]:
    """What the catalog query reads of a real PostgreSQL with DATABASE in it, for a rule on ``ssn``; and the names
    of the views' columns, by (view OID, column number)."""
    import asyncpg

    async def read() -> tuple[Catalog, dict[tuple[int, int], tuple[str, str]]]:
        database = f"computed_{uuid.uuid4().hex[:8]}"
        admin = await asyncpg.connect(pg_target.dsn())
        try:
            await admin.execute(f"create database {database}")
        finally:
            await admin.close()
        made = await asyncpg.connect(pg_target.dsn(database=database))
        try:
            await made.execute(DATABASE)
            rows = await made.fetch("select c.oid::int8, c.relname::text, a.attnum::int8, a.attname::text "
                                    "from pg_class c join pg_attribute a on a.attrelid = c.oid "
                                    "where c.relkind in ('v', 'm') and a.attnum > 0")
        finally:
            await made.close()
        settings = TargetSettings(host="127.0.0.1", port=pg_target.port, user="postgres",
                                  password=pg_target.password, database=database, sslmode="disable")
        found = await read_catalog(settings, "computed", DirectDialer(), ["ssn"], types=False)
        return found, {(oid, number): (view, column) for oid, view, number, column in rows}

    return asyncio.run(read())


@pytest.fixture(scope="module")
def builtins(catalog: tuple[Catalog, Any]) -> BuiltIns:
    assert catalog[0].builtins is not None
    return catalog[0].builtins


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
def test_a_statement_naming_a_masked_column_a_star_or_a_setting_mentions_one(text: str, builtins: BuiltIns) -> None:
    assert Mentions(builtins).read(text, WATCHED)


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
def test_a_statement_naming_none_mentions_none(text: str, builtins: BuiltIns) -> None:
    assert not Mentions(builtins).read(text, WATCHED)


@pytest.mark.parametrize("text", [
    "select get_ssn(1)",  # a function of the database's: it reads what it likes
    "select public.get_ssn(1)",
    'select "get_ssn"(1)',
    "select upper(x) from get_ssn(1) x",
    "call some_procedure(1)",  # a procedure's OUT values
    "select made_since_the_catalog_was_read(1)",  # not in the catalog: not known to be built in
    "select ### 1",  # an operator of the database's
    "select 1 operator(public.###) 1",
    "select 1::held",  # a cast that runs the database's function
    "select cast(1 as public.held)",
    "select query_to_xml('select s' || 'sn from people', true, false, '')",  # built in, runs SQL it is given
    "select table_to_xml('people', true, false, '')",
    "select pg_catalog.query_to_xml('select 1', true, false, '')",
    "select row_to_json(p) from people p",  # a whole row by its bare name
    "select p::text from people p",
    "select people is null from people",
    "select count(*) from people where",  # does not parse: not known
])
def test_a_statement_running_what_the_database_defined_mentions_one(text: str, builtins: BuiltIns) -> None:
    assert Mentions(builtins).read(text, WATCHED)
    assert Mentions().read("select 1", WATCHED)  # with nothing read of the catalog, nothing is built in


@pytest.mark.parametrize("text", [
    "select upper(name), pg_catalog.lower(name), length(name) + 1 from people",
    "select coalesce(name, ''), greatest(1, 2), extract(year from now()), substring(name from 1) from people",
    "select count(*) filter (where total > 1) over (partition by person), total between 1 and 9 from orders",
    "select name::varchar(10), 1::int8, 'x' like 'y%' from people",
    "select p.name, o.total from people p join orders o on o.person = p.id",
    "select hstore('a', name) = 'a=>1'::hstore, pg_catalog.upper(name), public.hstore('b', '2') from people",
])
def test_a_statement_running_only_built_ins_mentions_none(text: str, builtins: BuiltIns) -> None:
    assert not Mentions(builtins).read(text, WATCHED)


def test_executing_or_fetching_answers_for_the_statement_that_defined_the_name(builtins: BuiltIns) -> None:
    """``EXECUTE`` and ``FETCH`` name no column: they answer for their ``PREPARE`` / ``DECLARE``; a name never
    seen defined (a cursor a function opened) mentions one; a change of the rules forgets every answer."""
    mentions = Mentions(builtins)
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


def test_a_query_of_the_catalog_alone_computes_nothing_from_a_masked_column(builtins: BuiltIns) -> None:
    """A driver's own queries name ``name`` or ``kind`` (asyncpg's type introspection): they read the catalog
    only, and their computed columns must pass (asyncpg failed on any enum or composite type under a rule on
    ``name``). A table of the database's, a function in FROM, or a table of the catalog's that holds data or
    statements a session wrote (statistics' sample values, settings) make a query not one of the catalog."""
    import asyncpg.introspection as introspection

    watched = {"name": "fixed", "kind": "fixed"}
    for query in (introspection.INTRO_LOOKUP_TYPES_13, introspection.TYPE_BY_NAME, introspection._TYPEINFO_13,
                  "select c.relname::text as name from pg_catalog.pg_class c",
                  "select upper(table_name) as name from information_schema.columns"):
        assert not Mentions(builtins).read(query, watched), query[:80]
    for query in ("select upper(name) from pg_class, people",
                  "select upper(name) from pg_people",  # not the catalog's: a table of the database's
                  "select most_common_vals::text as name from pg_stats",
                  "select setting || '' as name from pg_settings",
                  "select upper(name) from pg_catalog.pg_class, generate_series(1, 2)",
                  "with people as (select name from public.people) select upper(name) from people"):
        assert Mentions(builtins).read(query, watched), query


def test_a_view_s_column_that_may_carry_a_masked_column_is_masked(
        catalog: tuple[Catalog, dict[tuple[int, int], tuple[str, str]]]) -> None:
    """A view's column has the view as its source: one that follows a masked column (renamed, through a view of a
    view, in a materialized view), or one a view computes while it names one (or a whole row, or in a UNION), is
    masked; a plain column of a table, or what a view computes naming no masked column, is not."""
    found, names = catalog
    by_view: dict[str, set[str]] = {}
    for identity, rule in found.views.items():
        assert rule == "ssn"
        view, column = names[identity]
        by_view.setdefault(view, set()).add(column + (" (computed)" if identity in found.computed else ""))
    assert by_view == {"plain": {"tax_id"}, "computed": {"s (computed)", "n (computed)"},
                       "unioned": {"id (computed)", "x (computed)"}, "nested": {"t"}, "rows": {"j (computed)"},
                       "copied": {"kept"}}
