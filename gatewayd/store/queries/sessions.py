"""Sessions and their recordings: claiming, the event batches of the hash chain, late events, reading back."""

from __future__ import annotations

import asyncio
from operator import itemgetter
from typing import Any, Iterable, Sequence

from gatewayd.evidence import LATE_BASE, BatchLink, EventBatch, chain_hash, pack_events, unpack_events
from gatewayd.models import CHAIN_GENESIS, Page, Review, Session, SessionEvent, rfc3339, utcnow
from gatewayd.store.base import SessionFilter
from gatewayd.store.search import MIN_SEARCH, TEXT_COUNT_CAP, TEXT_PROBE, input_text, like_pattern
from gatewayd.store.sql import Row, Statement, Work, assign, build, built, columns, encode, insert
from gatewayd.store.queries.reports import ReportQueries
from gatewayd.store.queries.reviews import REVIEW_COLUMNS, ReviewQueries
from gatewayd.tasks import together

# A user filter that matches fewer users than this has its page merged from each user's own newest sessions.
USER_ARMS = 32
# The users a user filter names by part of their e-mail or name (parameters: the organization, the pattern twice).
MATCHED_USERS = ("SELECT subject FROM users WHERE org_id = ? AND (lower(email) LIKE ? ESCAPE '!' "
                 "OR lower(name) LIKE ? ESCAPE '!')")

# Session columns a recording flush may write beside its events (its progress, not its state).
RECORDING_FIELDS = frozenset({"event_size", "metrics", "chain_head"})
_seq_of = itemgetter(0)

# A session a connection may claim: issued ready, or open with its jit credentials handed out, not
# ended, not claimed, no kill asked for.
CLAIMABLE = ("claimed_at IS NULL AND kill_requested_at IS NULL AND end_date IS NULL "
             "AND status IN ('ready', 'open')")


def _number_events(rows: list[Any], batches: list[Any], kinds: str | None) -> list[tuple[int, SessionEvent]]:
    """A session's (sequence number, event) pairs from its rows of one event each and its packed batches (of
    ``kinds`` only, when given)."""
    found = [(r[0], SessionEvent(r[1], r[2], bytes(r[3]))) for r in rows]
    for (packed,) in batches:
        found += unpack_events(bytes(packed))
    if rows and len(found) > len(rows):
        found.sort(key=_seq_of)
    return found if kinds is None else [pair for pair in found if pair[1].kind in kinds]


class SessionQueries(ReportQueries, ReviewQueries):
    """Sessions and their events (a session that ends is counted in the rollup: ``ReportQueries``)."""

    async def create_session(self, session: Session) -> None:
        await self._write([insert("sessions", session)])

    async def get_session(self, session_id: str) -> Session | None:
        row = await self._one("SELECT * FROM sessions WHERE id = ?", (session_id,))
        return build(Session, row) if row else None

    async def list_sessions(self, query: SessionFilter, *, reviews: bool = False) -> Page:
        """Sessions newest first, the total counted up to ``count_cap`` (``total_exact`` False past it). A text
        search first asks the text index for at most TEXT_PROBE matches: fewer (a rare text), and the sessions are
        those; more (a common one), and the sessions are read newest first, each checked against the text's
        matches, and counted among its first TEXT_COUNT_CAP index rows only (``total_exact`` False when it has
        more). A user filter is first resolved to the users it matches; fewer than USER_ARMS, and the page is
        merged from each one's newest sessions. The count and the page are read at once. ``reviews``: the page's
        sessions' reviews too (``Page.reviews``), in the page's own statement."""
        where, params = ["org_id = ?"], [query.org_id]
        for column, value in (("user_id", query.user_id), ("user_id", query.only_user_id),
                              ("connection", query.connection), ("type", query.type), ("subtype", query.protocol),
                              ("status", query.status), ("tracker_issue_key", query.tracker_issue_key)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        capped = False
        if query.text:
            if len(query.text) < MIN_SEARCH:
                raise ValueError(f"a search needs at least {MIN_SEARCH} characters")
            matches, needle = self.dialect.text_matches(query.text)
            probe = await self._all(f"{matches} LIMIT ?", (needle, TEXT_PROBE + 1))
            if len(probe) <= TEXT_PROBE:  # a rare text: its sessions, by primary key
                found = list(dict.fromkeys(r[0] for r in probe)) or [""]
                where[0] = f"{self.dialect.driven_by_text('org_id')} = ?"
                where.append(f"id IN ({', '.join('?' * len(found))})")
                params += found
            else:  # a common one: newest first through the other filters, each session checked
                capped = True
                text_at = len(where)
                where.append(f"id IN ({matches})")
                params.append(needle)
        if query.start_date:
            where.append("start_date >= ?")
            params.append(query.start_date)
        if query.end_date:
            where.append("start_date <= ?")
            params.append(query.end_date)
        if query.review_status:
            # the organization's reviews only, as the page joins them: a review id naming another's matches nothing
            where.append("review_id IN (SELECT id FROM reviews WHERE status = ? AND org_id = ?)")
            params.extend((query.review_status, query.org_id))
        if query.review_approver:
            where.append("review_id IN (SELECT g.review_id FROM review_groups g JOIN reviews r ON r.id = g.review_id "
                         "WHERE lower(g.reviewed_by_email) = lower(?) AND r.org_id = ?)")
            params.extend((query.review_approver, query.org_id))
        users: list[str] = []  # the subjects a user filter matches, when few enough to merge (last in ``where``)
        if query.user_search:  # the subject itself, or part of an e-mail or name (users: a small table)
            pattern = like_pattern(query.user_search.lower())
            found = await self._all(f"{MATCHED_USERS} LIMIT ?", (query.org_id, pattern, pattern, USER_ARMS))
            if len(found) < USER_ARMS:
                users = list(dict.fromkeys([query.user_search, *(r[0] for r in found)]))
                where.append(f"user_id IN ({', '.join('?' * len(users))})")
                params += users
            else:
                where.append(f"user_id IN (SELECT ? UNION {MATCHED_USERS})")
                params += [query.user_search, query.org_id, pattern, pattern]
        clause = " AND ".join(where)
        if capped:  # counted from the text's first TEXT_COUNT_CAP index rows, by primary key
            bounded = list(where)
            bounded[0] = f"{self.dialect.driven_by_text('org_id')} = ?"
            bounded[text_at] = f"id IN ({matches} LIMIT {TEXT_COUNT_CAP})"
            counted = self._text_count(f"SELECT COUNT(*) FROM sessions WHERE {' AND '.join(bounded)}", params,
                                       f"SELECT COUNT(*) FROM ({matches} LIMIT {TEXT_COUNT_CAP + 1}) AS rows_found",
                                       needle)
        else:
            counted = self._capped_count(f"SELECT 1 FROM sessions WHERE {clause}", params)
        names = ", ".join(f"sessions.{n}" for n in columns(Session) if n != "script")
        # start_date and id are NOT NULL: no NULLS placement, and the order is the indexes' own (org_id, a
        # filter's column, start_date DESC, id), so the page is read from an index, not sorted. The page's ids are
        # found first (from the index alone where it holds the filters' columns), then only those rows are read.
        order = "ORDER BY start_date DESC, id"
        ids, ids_params = f"SELECT id FROM sessions WHERE {clause} {order} LIMIT ? OFFSET ?", list(params)
        reach = query.offset + query.limit + 1
        if len(users) > 1 and not query.text and reach <= self.count_cap:
            # several users: each one's newest sessions up to the page's end from its own index range, merged (an IN
            # list of users is read whole from the index and sorted: 10,822 entries for 11 users, 7-9 ms; merged,
            # at most 11 x 101, 1.3 ms)
            others, shared = " AND ".join(where[:-1]), params[:-len(users)]
            ids = " UNION ALL ".join(
                f"SELECT id, start_date FROM (SELECT id, start_date FROM sessions WHERE {others} AND user_id = ? "
                f"{order} LIMIT {int(reach)}) AS of_user_{n}" for n in range(len(users)))
            ids = f"SELECT id FROM ({ids}) AS of_users {order} LIMIT ? OFFSET ?"
            ids_params = [value for user in users for value in (*shared, user)]
        joined = f", {REVIEW_COLUMNS}" if reviews else ""
        source = ("sessions LEFT JOIN reviews ON reviews.id = sessions.review_id AND reviews.org_id = sessions.org_id"
                  if reviews else "sessions")  # a review of the session's own organization, or none
        (total, exact), (rows, linked) = await together(counted, self._page_of(
            f"SELECT {names}, sessions.script{joined} FROM {source} WHERE sessions.id IN ({ids}) "
            "ORDER BY sessions.start_date DESC, sessions.id", tuple(ids_params) + (query.limit + 1, query.offset),
            query.limit, reviews))
        return Page(items=built(Session, rows[:query.limit]), total=total, total_exact=exact,
                    more=len(rows) > query.limit, reviews=linked)

    async def _page_of(self, sql: str, params: tuple[Any, ...], limit: int,
                       reviews: bool) -> tuple[list[Row], dict[str, Review]]:
        """A session page's rows (one past its ``limit`` where more follow) and, with ``reviews``, the reviews its
        sessions carry, with their groups' parts: read while the page's count may still run."""
        rows = await self._all(sql, params)
        return rows, (await self._joined_reviews(rows[:limit]) if reviews else {})

    async def _text_count(self, sessions: str, params: list[Any], matches: str, value: str) -> tuple[int, bool]:
        """A common text's total: its sessions among the text's first TEXT_COUNT_CAP index rows, and whether the
        text has no more rows than those (both read at once)."""
        total, rows = await together(self._count(sessions, params), self._count(matches, [value]))
        return total, rows <= TEXT_COUNT_CAP

    def _returning(self, statement: Statement, key: str) -> Work[Session | None]:
        """An UPDATE of one session, and the session as it is after it (None when no row matched).

        ``RETURNING *`` where the dialect has it; else the UPDATE and a SELECT in the same write
        transaction, which holds the row.
        """
        sql, params = statement
        if self.dialect.returning:
            done = yield sql + " RETURNING *", params
            return build(Session, done.rows[0]) if done.rows else None
        done = yield sql, params
        if done.rowcount != 1:
            return None
        row = yield "SELECT * FROM sessions WHERE id = ?", (key,)
        return build(Session, row.rows[0]) if row.rows else None

    async def claim_session(self, session_id: str, start_date: str, node_id: str | None = None) -> Session | None:
        return await self.db.transact(self._returning((
            "UPDATE sessions SET status = 'open', start_date = ?, claimed_at = ?, node_id = ? "
            f"WHERE id = ? AND {CLAIMABLE}", (start_date, rfc3339(utcnow()), node_id, session_id)), session_id))

    async def start_session(self, session_id: str, start_date: str) -> bool:
        done = await self.db.transact(self._returning((
            "UPDATE sessions SET status = 'open', start_date = ? WHERE id = ? AND status = 'ready' "
            "AND kill_requested_at IS NULL", (start_date, session_id)), session_id))
        return done is not None

    async def request_kill(self, session_id: str, reason: str, requested_at: str) -> Session | None:
        return await self.db.transact(self._returning((
            "UPDATE sessions SET kill_requested_at = COALESCE(kill_requested_at, ?), "
            "kill_reason = COALESCE(kill_reason, ?) WHERE id = ? AND status != 'done'",
            (requested_at, reason, session_id)), session_id))

    async def set_ai_analysis(self, session_id: str, analysis: dict[str, Any] | None, *,
                              status: str | None = None) -> bool:
        where, params = "id = ?", [session_id]
        if status is not None:
            where += " AND status = ?"
            params.append(status)
        done = await self.db.transact(self._returning(
            ("UPDATE sessions SET ai_analysis = ? WHERE " + where, (encode("ai_analysis", analysis), *params)),
            session_id))
        return done is not None

    def _store_batches(self, batches: Iterable[EventBatch], diverged: set[str]) -> Work[None]:
        """Insert each batch unless it is stored already; a session whose numbers hold another hash is
        ``diverged``: none of its later batches nor its fields are written."""
        for batch in batches:
            unknown = set(batch.session_fields) - RECORDING_FIELDS
            if unknown:
                raise ValueError(f"a recording batch may not write session fields {sorted(unknown)}")
            sid = batch.session_id
            if sid in diverged:
                continue
            if batch.count:
                done = yield ("INSERT INTO session_event_batches (session_id, first_seq, count, prev_hash, hash, events) "
                              "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (session_id, first_seq) DO NOTHING",
                              (sid, batch.first_seq, batch.count, batch.previous_hash, batch.hash, batch.packed))
                if done.rowcount != 1:
                    there = yield ("SELECT hash FROM session_event_batches WHERE session_id = ? AND first_seq = ?",
                                   (sid, batch.first_seq))
                    if not there.rows or there.rows[0][0] != batch.hash:
                        diverged.add(sid)
                        continue
                elif batch.sizes.get("i") and (text := input_text(batch.packed)):  # what was typed, searchable
                    for statement in self.dialect.search_insert(sid, text):  # once: not again on a replay
                        yield statement
            if batch.session_fields:
                yield assign("sessions", batch.session_fields, "id = ? AND status != 'done'", (sid,))

    def _append(self, batches: Iterable[EventBatch]) -> Work[set[str]]:
        diverged: set[str] = set()
        yield from self._store_batches(batches, diverged)
        return diverged

    async def append_events(self, batches: Iterable[EventBatch]) -> set[str]:
        batches = list(batches)
        if not batches:
            return set()
        return await self.db.transact(self._append(batches))

    def _close(self, batches: Sequence[EventBatch], end_date: str, exit_code: int | None,
               seal: str | None) -> Work[bool]:
        """The last events and the end, and (the first time it ends) the session counted in ``session_rollup``."""
        diverged: set[str] = set()
        sid = batches[-1].session_id
        before = yield ("SELECT status, org_id, start_date, connection, user_email, subtype, verb, event_size, "
                        "metrics FROM sessions WHERE id = ?", (sid,))
        # the fields first: a close stored already (a retry after an unknown outcome) leaves them as they are
        yield from self._store_batches(batches, diverged)
        if diverged:
            return False
        done = yield assign("sessions", {"status": "done", "end_date": end_date, "exit_code": exit_code, "seal": seal},
                            "id = ? AND status != 'done'", (sid,))
        if done.rowcount == 1:
            if before.rows and before.rows[0][0] != "done":
                yield from self._counted(before.rows[0], batches[-1], end_date)
            return True
        row = yield ("SELECT seal, end_date FROM sessions WHERE id = ?", (sid,))
        return bool(row.rows) and (row.rows[0][0], row.rows[0][1]) == (seal, end_date)  # this close, stored before

    async def close_session(self, batches: Sequence[EventBatch], *, end_date: str, exit_code: int | None,
                            seal: str | None) -> bool:
        return await self.db.transact(self._close(list(batches), end_date, exit_code, seal))

    def _late(self, session_id: str, events: Sequence[tuple[int, SessionEvent]], note: str) -> Work[int]:
        last = yield ("SELECT first_seq, count, hash FROM session_event_batches WHERE session_id = ? "
                      "ORDER BY first_seq DESC LIMIT 1", (session_id,))
        previous, covered = CHAIN_GENESIS, -1
        if last.rows:
            first, count, previous = int(last.rows[0][0]), int(last.rows[0][1]), last.rows[0][2]
            if first >= LATE_BASE:  # own number n is kept as LATE_BASE + 1 + n (the note before the first)
                covered = first + count - 1 - LATE_BASE - 1  # the last own number kept late already
        fresh = sorted(((seq, e) for seq, e in events if seq > covered), key=lambda pair: pair[0])
        if fresh and covered < 0:
            # the first of them may be in the recording already, under their own numbers: a batch stored before the
            # close whose write's answer the holder never had (a cut link) is not kept a second time
            found = yield ("SELECT events FROM session_event_batches WHERE session_id = ? AND first_seq < ? AND "
                           "first_seq <= ? AND first_seq + count > ? AND events IS NOT NULL",
                           (session_id, LATE_BASE, fresh[-1][0], fresh[0][0]))
            stored = dict(pair for row in found.rows for pair in unpack_events(row[0]))
            kept = 0
            while kept < len(fresh) and stored.get(fresh[kept][0]) == fresh[kept][1]:
                kept += 1
            fresh = fresh[kept:]
        if not fresh:
            return 0
        if covered < 0:
            first_seq = LATE_BASE + fresh[0][0]
            numbered = [SessionEvent(fresh[0][1].offset_ms, "e", note.encode())] + [e for _, e in fresh]
        else:
            first_seq = LATE_BASE + 1 + covered + 1
            numbered = [e for _, e in fresh]
        packed = pack_events(first_seq, numbered)
        link = chain_hash(previous, session_id, packed)
        yield ("INSERT INTO session_event_batches (session_id, first_seq, count, prev_hash, hash, events) "
               "VALUES (?, ?, ?, ?, ?, ?)", (session_id, first_seq, len(numbered), previous, link, packed))
        return len(fresh)

    async def append_late(self, session_id: str, events: Sequence[tuple[int, SessionEvent]], note: str) -> int:
        return await self.db.transact(self._late(session_id, events, note))

    async def chain_tail(self, session_id: str) -> tuple[int, str]:
        last = await self._one("SELECT first_seq, count, hash FROM session_event_batches WHERE session_id = ? "
                               "AND first_seq < ? ORDER BY first_seq DESC LIMIT 1", (session_id, LATE_BASE))
        return (int(last[0]) + int(last[1]), last[2]) if last is not None else (0, CHAIN_GENESIS)

    async def _numbered_events(self, session_id: str, kinds: str | None = None) -> list[tuple[int, SessionEvent]]:
        """A session's (sequence number, event) pairs in order (of ``kinds`` only, when given): packed per batch,
        and before that (recordings stored before batches held their events) one row each."""
        rows = await self.db.fetch(
            "SELECT seq, offset_ms, kind, data FROM session_events WHERE session_id = ? ORDER BY seq", (session_id,),
            slow=True)
        batches = await self.db.fetch("SELECT events FROM session_event_batches WHERE session_id = ? "
                                      "AND events IS NOT NULL ORDER BY first_seq", (session_id,), slow=True)
        # a recording runs to tens of megabytes: unpacked off the event loop, which serves every proxy
        return await asyncio.to_thread(_number_events, rows, batches, kinds)

    async def read_events(self, session_id: str, kinds: str | None = None) -> list[SessionEvent]:
        return [event for _, event in await self._numbered_events(session_id, kinds)]

    async def read_events_after(self, session_id: str, after: int) -> list[tuple[int, SessionEvent]]:
        rows = await self._all("SELECT seq, offset_ms, kind, data FROM session_events WHERE session_id = ? AND seq > ? "
                               "ORDER BY seq", (session_id, after))
        # from the batch holding the first event wanted (found on the primary key), not the whole recording
        batches = await self._all(
            "SELECT events FROM session_event_batches WHERE session_id = ? AND events IS NOT NULL AND first_seq >= "
            "COALESCE((SELECT MAX(first_seq) FROM session_event_batches WHERE session_id = ? AND first_seq <= ?), 0) "
            "ORDER BY first_seq", (session_id, session_id, after + 1))
        if not rows and not batches:
            return []
        found = await asyncio.to_thread(_number_events, rows, batches, None)
        return [pair for pair in found if pair[0] > after]

    async def read_event_chain(self, session_id: str) -> tuple[list[BatchLink], list[tuple[int, SessionEvent]]]:
        links = await self._all("SELECT first_seq, count, prev_hash, hash FROM session_event_batches "
                                "WHERE session_id = ? ORDER BY first_seq", (session_id,))
        return [BatchLink(r[0], r[1], r[2], r[3]) for r in links], await self._numbered_events(session_id)

    async def last_event_seq(self, session_id: str) -> tuple[int, int]:
        last = await self._one("SELECT first_seq, count, events FROM session_event_batches WHERE session_id = ? "
                               "AND events IS NOT NULL AND first_seq < ? ORDER BY first_seq DESC LIMIT 1",
                               (session_id, LATE_BASE))
        if last is not None:
            numbered = unpack_events(bytes(last[2]))
            if numbered and numbered[-1][0] == last[0] + last[1] - 1:
                return numbered[-1][0] + 1, numbered[-1][1].offset_ms
            return last[0] + last[1], 0  # an altered batch (verification says so): numbered on after its link
        row = await self._one(
            "SELECT seq, offset_ms FROM session_events WHERE session_id = ? ORDER BY seq DESC LIMIT 1", (session_id,))
        return (row[0] + 1, row[1]) if row else (0, 0)

    async def sessions_with_status(self, status: str) -> list[Session]:
        rows = await self._all("SELECT * FROM sessions WHERE status = ?", (status,))
        return built(Session, rows)

    async def open_sessions_of(self, node_ids: Iterable[str]) -> list[Session]:
        wanted = list(node_ids)
        if not wanted:
            return []
        rows = await self._all(f"SELECT * FROM sessions WHERE status = 'open' AND node_id IN "
                               f"({', '.join('?' * len(wanted))})", tuple(wanted))
        return built(Session, rows)

    async def open_session_holders(self, *, review_id: str | None = None, connection_id: str | None = None,
                                   user: tuple[str, str] | None = None) -> set[str]:
        values: tuple[str | None, ...]
        if user is not None:
            where, values = "org_id = ? AND user_id = ?", user
        elif review_id is not None:
            where, values = "review_id = ?", (review_id,)
        else:
            where, values = "connection_id = ?", (connection_id,)
        rows = await self._all(f"SELECT DISTINCT node_id FROM sessions WHERE status = 'open' AND {where} "
                               "AND node_id IS NOT NULL", values)
        return {row[0] for row in rows}

    async def open_sessions_unheld(self) -> list[Session]:
        rows = await self._all("SELECT * FROM sessions WHERE status = 'open' AND (node_id IS NULL OR node_id NOT IN "
                               "(SELECT id FROM nodes WHERE status = 'up'))")
        return built(Session, rows)

    async def ids_with_prefix(self, table: str, org_id: str, prefix: str, limit: int = 3) -> list[str]:
        if table not in ("reviews", "sessions"):
            raise ValueError(f"no short ids in {table}")
        # a range on the primary key (code point order in both backends): '~' sorts after every id character
        rows = await self._all(f"SELECT id FROM {table} WHERE id >= ? AND id < ? AND org_id = ? "
                               f"ORDER BY {self.dialect.sort('id', text=True)} LIMIT ?",
                               (prefix, prefix + "~", org_id, limit))
        return [r[0] for r in rows]

    async def sessions_by_ids(self, session_ids: Iterable[str]) -> dict[str, Session]:
        ids = list(dict.fromkeys(i for i in session_ids if i))
        if not ids:
            return {}
        rows = await self._all(f"SELECT * FROM sessions WHERE id IN ({', '.join('?' * len(ids))})", tuple(ids))
        return {r["id"]: build(Session, r) for r in rows}

    async def set_session_metadata(self, session_id: str, metadata: dict[str, Any]) -> bool:
        return await self._changed(assign("sessions", {"metadata": metadata}, "id = ?", (session_id,))) == 1
