"""Reviews (access requests and their approval groups) and the access-request rules."""

from __future__ import annotations

from typing import Any, Sequence

from gatewayd.models import AccessRequestRule, Page, Review, ReviewGroup, Session
from gatewayd.store.sql import Row, Work, build, built, encode, in_order, insert, joined, joined_columns, update
from gatewayd.store.queries.core import SQLCore

# A page of another table's rows may carry each row's review in columns of its own, named apart (REVIEW_COLUMNS,
# read with ``ReviewQueries._joined_reviews``).
REVIEW_PREFIX = "review__"
REVIEW_COLUMNS = joined_columns(Review, "reviews", REVIEW_PREFIX, skip=("groups",))


class ReviewQueries(SQLCore):
    """Reviews and access-request rules."""

    def _review_statements(self, review: Review) -> list[tuple[str, Any]]:
        return [
            ("DELETE FROM review_groups WHERE review_id = ?", (review.id,)),
            ("INSERT INTO review_groups (id, review_id, group_name, forced_review, status, review_date, "
             "reviewed_by_id, reviewed_by_email, reviewed_by_name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
             [(g.id, review.id, g.group_name, int(g.forced_review), g.status, g.review_date, g.reviewed_by_id,
               g.reviewed_by_email, g.reviewed_by_name) for g in review.groups]),
        ]

    async def create_review(self, review: Review, session: Session | None = None) -> None:
        statements = [insert("sessions", session)] if session is not None else []
        statements.append(insert("reviews", review, skip=("groups",)))
        await self._write(statements + self._review_statements(review))

    async def _reviews_from(self, rows: list[Row]) -> list[Review]:
        if not rows:
            return []
        return self._built(rows, await self._groups_of([r["id"] for r in rows]))

    async def _groups_of(self, ids: list[str]) -> dict[str, list[ReviewGroup]]:
        """The groups' parts in the reviews ``ids``, by review."""
        groups: dict[str, list[ReviewGroup]] = {}
        marks = ", ".join("?" * len(ids))
        for g in await self._all(f"SELECT * FROM review_groups WHERE review_id IN ({marks}) "
                                 f"ORDER BY {self.dialect.row_order}", tuple(ids)):
            group = build(ReviewGroup, g)
            group.forced_review = bool(group.forced_review)
            groups.setdefault(g["review_id"], []).append(group)
        return groups

    async def _joined_reviews(self, rows: Sequence[Row]) -> dict[str, Review]:
        """The reviews that ``rows`` carry in REVIEW_COLUMNS (a LEFT JOIN of ``reviews``), by id, with their groups'
        parts."""
        found = {review.id: review for review in joined(Review, rows, REVIEW_PREFIX)}
        if found:
            for review_id, parts in (await self._groups_of(list(found))).items():
                found[review_id].groups = parts
        return found

    @staticmethod
    def _built(rows: list[Row], groups: dict[str, list[ReviewGroup]]) -> list[Review]:
        return [build(Review, r, groups=groups.get(r["id"], [])) for r in rows]

    async def get_review(self, review_id: str) -> Review | None:
        found = await self._reviews_from(await self._all("SELECT * FROM reviews WHERE id = ?", (review_id,)))
        return found[0] if found else None

    async def get_review_by_session(self, session_id: str) -> Review | None:
        found = await self._reviews_from(await self._all(
            "SELECT * FROM reviews WHERE session_id = ? ORDER BY created_at DESC LIMIT 1", (session_id,)))
        return found[0] if found else None

    async def list_reviews(self, org_id: str, *, status: str | None = None, type: str | None = None,
                           visible_to: tuple[str, list[str]] | None = None, limit: int = 100,
                           offset: int = 0) -> Page:
        where, params = ["org_id = ?"], [org_id]
        for column, value in (("status", status), ("type", type)):
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        if visible_to is not None:
            owner, groups = visible_to
            clause = "owner_id = ?"
            params.append(owner)
            if groups:
                marks = ", ".join("?" * len(groups))
                clause += (f" OR id IN (SELECT review_id FROM review_groups WHERE group_name IN ({marks}))"
                           f" OR {self.dialect.json_has_any('reviews.force_approval_groups', len(groups))}")
                params += list(groups) * 2
            where.append(f"({clause})")
        sql = " AND ".join(where)
        total = await self._count(f"SELECT COUNT(*) FROM reviews WHERE {sql}", params)
        rows = await self._all(f"SELECT * FROM reviews WHERE {sql} ORDER BY created_at DESC, "
                               f"{self.dialect.sort('id', text=True)} LIMIT ? OFFSET ?",
                               tuple(params) + (limit, offset))
        return Page(items=await self._reviews_from(rows), total=total)

    async def save_review(self, review: Review, *, was: tuple[str, str | None] | None = None) -> bool:
        return await self.db.transact(self._saved_review(review, was))

    def _saved_review(self, review: Review, was: tuple[str, str | None] | None) -> Work[bool]:
        """The review's row, then its groups -- only when the row still had ``was`` (status, updated_at)."""
        params: tuple[Any, ...]
        sql, params = ("UPDATE reviews SET status = ?, time_window = ?, revoke_at = ?, updated_at = ?, "
                       "force_approval_groups = ? WHERE id = ?",
                       (review.status, encode("time_window", review.time_window), review.revoke_at,
                        review.updated_at, encode("force_approval_groups", review.force_approval_groups), review.id))
        if was is not None:
            sql, params = sql + " AND status = ? AND COALESCE(updated_at, '') = ?", params + (was[0], was[1] or "")
        done = yield sql, params
        if done.rowcount != 1:
            return False
        yield from in_order(self._review_statements(review))
        return True

    async def transition_review(self, review_id: str, from_status: str, to_status: str, at: str) -> bool:
        return await self._changed(("UPDATE reviews SET status = ?, updated_at = ? WHERE id = ? AND status = ?",
                                    (to_status, at, review_id, from_status))) == 1

    async def reviews_with_status(self, status: str, type: str | None = None) -> list[Review]:
        if type is None:
            rows = await self._all("SELECT * FROM reviews WHERE status = ?", (status,))
        else:
            rows = await self._all("SELECT * FROM reviews WHERE status = ? AND type = ?", (status, type))
        return await self._reviews_from(rows)

    async def open_review_for(self, request_key: str) -> Review | None:
        found = await self._reviews_from(await self._all(
            "SELECT * FROM reviews WHERE request_key = ? AND status IN ('PENDING', 'APPROVED') "
            "ORDER BY created_at DESC LIMIT 1", (request_key,)))
        return found[0] if found else None

    async def save_access_rule(self, rule: AccessRequestRule, *, create: bool) -> None:
        statement = insert("access_request_rules", rule) if create else \
            update("access_request_rules", rule, skip=("created_at",))
        await self._write([statement])

    async def get_access_rule(self, org_id: str, name: str) -> AccessRequestRule | None:
        row = await self._one("SELECT * FROM access_request_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name, name))
        return build(AccessRequestRule, row) if row else None

    async def list_access_rules(self, org_id: str) -> list[AccessRequestRule]:
        rows = await self._all(f"SELECT * FROM access_request_rules WHERE org_id = ? ORDER BY {self._by_name}",
                               (org_id,))
        return built(AccessRequestRule, rows)

    async def delete_access_rule(self, org_id: str, name: str) -> None:
        await self._write([("DELETE FROM access_request_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name, name))])
