"""Tamper evidence for recordings and the audit log: hash chains, a signed seal, and their verification.

A session's events are stored in batches; each batch's hash covers the previous batch's hash and
every event of the batch (sequence number, offset, kind, bytes), so the last hash -- the session's
``chain_head`` -- stands for the whole recording. At close the gateway signs a seal statement with
its own Ed25519 key, which is sealed at rest by the master key: the session's identity (id,
organization, user, connection, verb, start, the script's digest), the chain head, how many events
and bytes, the exit code and end date. Altering, removing, reordering or adding an event, or
changing who, what, when or how it ended, breaks the chain or the seal; rewriting the whole chain
also needs the key.

The fact of sealing is kept outside the session's row: a ``session.seal`` entry of the audit log
(with the seal), so a session once sealed is never sealed again (the sweep of sessions left open
asks first) and verification tells a seal removed, replaced or made twice.

The audit log is chained per organization the same way, one entry a link; each link is an HMAC
under a key derived from the seal key (``Sealer.audit_key``), so someone who can write the store
cannot re-compute it. Pure functions and one key holder; the store keeps the links, ``verify_*``
re-computes them. What this can and cannot tell is written down in docs/evidence.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gatewayd.models import CHAIN_GENESIS as GENESIS
from gatewayd.models import SessionEvent


class KeyStore(Protocol):
    """Where the sealer keeps its key (the store, which seals it with the master key): two calls, no more."""

    async def get_key(self, name: str) -> bytes | None: ...

    async def put_key(self, name: str, material: bytes) -> None: ...


SEAL_KEY_NAME = "recording-seal"
SEAL_V2 = "v2:"  # a seal over the session's identity too (``identity_statement``); one without it is older
SEALED = "session.seal"  # the audit action that records a session's sealing, with its seal
EVENT_HEAD = struct.Struct(">QQ1sQ")  # a stored event's head: seq, offset_ms, kind, length
# Links numbered from here hold events stored after the session was closed by another process (kept by the
# process that held it, in memory or in its journal): after the sealed recording, named by verification.
LATE_BASE = 1 << 40
GAP = b"recording gap: "  # an ``e`` event saying what the recording may miss; verification names each
_AUDIT_FIELDS = ("id", "org_id", "created_at", "actor_subject", "actor_email", "actor_name", "resource_type",
                 "action", "outcome", "http_method", "http_path", "http_status", "client_ip",
                 "request_payload_redacted", "error_message")


def pack_events(first_seq: int, events: Iterable[SessionEvent]) -> bytes:
    """Events as a batch stores them: per event its head (sequence number, offset, kind, length), then its bytes.

    The recorder writes this form as events come (``gatewayd.recording``); ``chain_hash`` hashes it as it is.
    """
    return b"".join(EVENT_HEAD.pack(seq, max(event.offset_ms, 0), event.kind.encode()[:1], len(event.data))
                    + bytes(event.data) for seq, event in enumerate(events, first_seq))


def unpack_events(packed: bytes) -> list[tuple[int, SessionEvent]]:
    """A stored batch's (sequence number, event) pairs, in order; reading stops where the bytes stop making sense
    (an altered batch: its hash says so)."""
    found: list[tuple[int, SessionEvent]] = []
    at, end, head = 0, len(packed), EVENT_HEAD.size
    while at + head <= end:
        seq, offset_ms, kind, size = EVENT_HEAD.unpack_from(packed, at)
        at += head
        if at + size > end:
            break
        found.append((seq, SessionEvent(offset_ms, kind.decode("latin-1"), packed[at:at + size])))
        at += size
    return found


def chain_hash(previous: str, session_id: str, packed: bytes) -> str:
    """The hash of one stored batch (its events packed, ``pack_events``), chained to ``previous``."""
    digest = hashlib.sha256(b"gatewayd-events-v1\0")
    digest.update(previous.encode())
    digest.update(session_id.encode() + b"\0")
    digest.update(packed)
    return digest.hexdigest()


def batch_hash(previous: str, session_id: str, first_seq: int, events: Sequence[SessionEvent]) -> str:
    """The hash of one batch of a session's events numbered from ``first_seq``, chained to ``previous``."""
    return chain_hash(previous, session_id, pack_events(first_seq, events))


def seal_statement(session_id: str, chain_head: str, events: int, event_size: int, exit_code: int | None,
                   end_date: str | None) -> bytes:
    """What a seal made before seals covered the session's identity signs (v1: verified still, made no more)."""
    return "\n".join(("gatewayd-seal-v1", session_id, chain_head, str(events), str(event_size),
                      "" if exit_code is None else str(exit_code), end_date or "")).encode()


def session_identity(session: Any) -> list[str]:
    """What a seal covers of a session (a ``Session``) besides its recording: which session, whose, on which
    connection, how (verb, and the script's SHA-256), and when it started."""
    return [session.id, session.org_id, session.user_id, session.user_email, session.connection_id or "",
            session.connection, session.verb, session.start_date or "",
            hashlib.sha256((session.script or "").encode()).hexdigest()]


def identity_statement(identity: Sequence[str], chain_head: str, events: int, event_size: int,
                       exit_code: int | None, end_date: str | None) -> bytes:
    """What the seal signs (v2): the session's identity (``session_identity``), the recording's last hash and the
    session's closing facts, as one JSON list (no field can borrow another's text)."""
    return json.dumps(["gatewayd-seal-v2", *identity, chain_head, events, event_size, exit_code, end_date or ""],
                      separators=(",", ":"), ensure_ascii=False).encode()


def audit_hash(previous: str, row: dict[str, Any], key: bytes | None = None) -> str:
    """The hash of one audit entry as stored (``request_payload_redacted`` as its JSON text): with ``key`` an
    HMAC-SHA256 (v2, what the gateway writes), without one the plain SHA-256 of entries chained before (v1)."""
    canonical = json.dumps([row.get(name) for name in _AUDIT_FIELDS], separators=(",", ":"), ensure_ascii=False)
    if key is None:
        return hashlib.sha256(b"gatewayd-audit-v1\0" + previous.encode() + canonical.encode()).hexdigest()
    return hmac.new(key, b"gatewayd-audit-v2\0" + previous.encode() + canonical.encode(), "sha256").hexdigest()


class Sealer:
    """Signs and checks seals with the gateway's recording key (Ed25519)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self._public = private_key.public_key()

    @classmethod
    async def load(cls, store: KeyStore) -> "Sealer":
        """The gateway's recording key, made once and kept sealed by the master key in the store."""
        material = await store.get_key(SEAL_KEY_NAME)
        if material is None:
            material = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            await store.put_key(SEAL_KEY_NAME, material)
            material = await store.get_key(SEAL_KEY_NAME) or material  # a concurrent start may have won
        key = serialization.load_pem_private_key(material, None)
        assert isinstance(key, Ed25519PrivateKey)
        return cls(key)

    def sign(self, statement: bytes) -> str:
        return base64.b64encode(self._key.sign(statement)).decode()

    def seal(self, session: Any, chain_head: str, events: int, event_size: int, exit_code: int | None,
             end_date: str | None) -> str:
        """The seal of a session (a ``Session``, as stored) closing with these facts."""
        return SEAL_V2 + self.sign(identity_statement(session_identity(session), chain_head, events, event_size,
                                                      exit_code, end_date))

    @property
    def audit_key(self) -> bytes:
        """The key of the audit chain's links: derived from this key, so it is kept as this one is, and a store
        whose writer lacks the master key cannot re-compute the chain."""
        raw = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption())
        return hashlib.sha256(b"gatewayd-audit-chain-v2\0" + raw).digest()

    def valid(self, statement: bytes, signature: str) -> bool:
        try:
            self._public.verify(base64.b64decode(signature, validate=True), statement)
        except (InvalidSignature, ValueError):
            return False
        return True


@dataclass(slots=True)
class EventBatch:
    """Events of one session to append in one go (packed, ``pack_events``), with their chain link, the session
    fields to update, and the bytes per kind (``i``/``o``/``e``) for the metrics."""

    session_id: str
    first_seq: int
    count: int
    packed: bytes
    session_fields: dict[str, Any]
    previous_hash: str = GENESIS
    hash: str = GENESIS
    sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, session_id: str, first_seq: int, events: Sequence[SessionEvent], session_fields: dict[str, Any],
           previous_hash: str = GENESIS, hash: str = GENESIS) -> "EventBatch":
        """A batch of these events (the recorder packs as it records; this is for everything else)."""
        sizes: dict[str, int] = {}
        for event in events:
            sizes[event.kind] = sizes.get(event.kind, 0) + len(event.data)
        return cls(session_id, first_seq, len(events), pack_events(first_seq, events), session_fields,
                   previous_hash, hash, sizes)

    @property
    def events(self) -> list[SessionEvent]:
        return [event for _, event in unpack_events(self.packed)]

    def first_offset_ms(self) -> int:
        """The first event's offset from the session's start (0 for an empty batch)."""
        return EVENT_HEAD.unpack_from(self.packed)[1] if self.packed else 0


@dataclass(slots=True)
class BatchLink:
    """One stored link of a session's chain."""

    first_seq: int
    count: int
    previous_hash: str
    hash: str


@dataclass(slots=True)
class Verification:
    """The answer to "was this altered since it was written?"; ``problems`` says where, if so."""

    subject: str
    verified: bool = True
    sealed: bool = False
    links: int = 0
    entries: int = 0
    chain_head: str = GENESIS
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.verified = False
        self.problems.append(text)

    def as_json(self) -> dict[str, Any]:
        return {"subject": self.subject, "verified": self.verified, "sealed": self.sealed, "links": self.links,
                "entries": self.entries, "chain_head": self.chain_head, "problems": list(self.problems)}


def verify_recording(session: Any, links: Sequence[BatchLink], events: Sequence[tuple[int, SessionEvent]],
                     sealer: Sealer, sealings: Sequence[dict[str, Any]] = ()) -> Verification:
    """Re-compute a session's chain from its stored events and check the seal. ``session``: the stored ``Session``;
    ``events``: (seq, event); ``sealings``: the audit log's records of its sealing (``Store.sealings``)."""
    session_id, status, chain_head, seal = session.id, session.status, session.chain_head, session.seal
    event_size, exit_code, end_date = session.event_size, session.exit_code, session.end_date
    result = Verification(subject=f"session {session_id}", links=len(links), entries=len(events))
    if not chain_head:
        result.problem("recorded before this gateway chained recordings: it cannot be verified")
        return result
    if len({seq for seq, _ in events}) != len(events):
        result.problem("two events have the same sequence number")
    late_links = [link for link in links if link.first_seq >= LATE_BASE]
    links = [link for link in links if link.first_seq < LATE_BASE]
    late_events = [pair for pair in events if pair[0] >= LATE_BASE]
    events = [pair for pair in events if pair[0] < LATE_BASE]
    by_seq = dict(events)
    previous, expected_seq = GENESIS, 0
    for number, link in enumerate(links, 1):
        where = f"batch {number} (events {link.first_seq}-{link.first_seq + link.count - 1})"
        if link.first_seq != expected_seq:
            result.problem(f"{where}: starts at event {link.first_seq}, expected {expected_seq} (a batch is missing)")
        if link.previous_hash != previous:
            result.problem(f"{where}: does not chain to the batch before it")
        batch = [by_seq.get(seq) for seq in range(link.first_seq, link.first_seq + link.count)]
        if any(event is None for event in batch):
            result.problem(f"{where}: events are missing")
        elif batch_hash(link.previous_hash, session_id, link.first_seq, batch) != link.hash:  # type: ignore[arg-type]
            result.problem(f"{where}: its events were altered")
        previous, expected_seq = link.hash, link.first_seq + link.count
    # every event lies in a link: one numbered past the chain, below it or among the late ones without a link of
    # theirs was added afterwards (readers show it all the same)
    late_covered = {seq for link in late_links for seq in range(link.first_seq, link.first_seq + link.count)}
    extra = sorted([seq for seq in by_seq if seq >= expected_seq or seq < 0] +
                   [seq for seq, _ in late_events if seq not in late_covered])
    if extra:
        result.problem(f"events {extra[0]}-{extra[-1]} are not covered by the chain (added afterwards)")
    result.chain_head = previous
    if chain_head != previous:
        result.problem("the session's chain head does not match its last batch")
    for seq, event in events:
        if event.kind == "e" and bytes(event.data).startswith(GAP):
            result.problem(f"event {seq}: {bytes(event.data)[:300].decode('utf-8', 'replace')}")
    if late_links:
        _verify_late(result, session_id, previous, late_links, dict(late_events))
    if seal:
        result.sealed = True
        if seal.startswith(SEAL_V2):
            statement = identity_statement(session_identity(session), chain_head, len(events), event_size, exit_code,
                                           end_date)
            if not sealer.valid(statement, seal[len(SEAL_V2):]):
                result.problem("the seal does not match: the recording, the session's user, connection, verb, start "
                               "or script, or its closing fields were changed after close")
        elif not sealer.valid(seal_statement(session_id, chain_head, len(events), event_size, exit_code, end_date),
                              seal):
            result.problem("the seal does not match: the recording or its closing fields were changed after close")
        else:  # told, not counted as altered
            result.problems.append("sealed before seals covered who, what and when: the session's user, connection, "
                                   "verb, start and script are not covered")
    elif status == "done":
        result.problem("the session is done but has no seal")
    _check_sealings(result, seal, sealings)
    return result


def _verify_late(result: Verification, session_id: str, previous: str, links: Sequence[BatchLink],
                 by_seq: dict[int, SessionEvent]) -> None:
    """The links kept after the session was closed by another process: chained on, unaltered, and named."""
    count = 0
    for link in links:
        batch = [by_seq.get(seq) for seq in range(link.first_seq, link.first_seq + link.count)]
        if link.previous_hash != previous or any(event is None for event in batch) or \
                batch_hash(link.previous_hash, session_id, link.first_seq, batch) != link.hash:  # type: ignore[arg-type]
            result.problem(f"the events kept after the close (from event {link.first_seq - LATE_BASE}) were altered")
        previous, count = link.hash, count + link.count
    result.problem(f"{count} events were stored after the session was closed by another process (kept by the "
                   "process that held it, in memory or in its journal): they are not covered by the seal")


def _check_sealings(result: Verification, seal: str | None, sealings: Sequence[dict[str, Any]]) -> None:
    """The seal against the audit log's records of the session's sealing: one seal, this one (a close stored again
    after an outcome that was not known records the same seal twice: one seal still)."""
    sealings = list({s.get("seal"): s for s in reversed(sealings)}.values())[::-1]  # the first record of each seal
    if len(sealings) > 1:
        result.problem(f"it was sealed {len(sealings)} times (audit log, {', '.join(s['sealed_at'] for s in sealings)})"
                       ": a session is sealed once, so its recording or its row was altered and it was closed again")
    if sealings:
        if not seal:
            result.problem(f"it was sealed on {sealings[0]['sealed_at']} (audit log) but has no seal now: "
                           "the seal was removed")
        elif all(s.get("seal") != seal for s in sealings):
            result.problem("its seal is not the one the audit log recorded when it was sealed")
    elif seal and seal.startswith(SEAL_V2):
        result.problem("the audit log has no record of its sealing (the entry was removed, or the gateway stopped "
                       "between the two)")


def verify_audit(org_id: str, rows: Iterable[dict[str, Any]], key: bytes | None = None) -> Verification:
    """Re-compute an organization's audit chain from its stored entries, oldest first.

    With ``key`` (the gateway's: ``Sealer.audit_key``) a link verifies only as its HMAC, and every entry must be
    one: an entry without a hash, or hashed without the key, cannot be told from one whose hash was stripped or
    re-computed, so it is not verified (named with how many there are).  One exception, for a log begun before
    the chain was keyed (an upgrade): its oldest entries, linked by plain hashes from the start, count as links
    when the first keyed entry chains to them -- that entry's HMAC holds the hash of the last of them, so none of
    them can be changed (and the plain hashes re-computed) without breaking it.  A plain-hash run that no keyed
    entry follows proves nothing.  Without a key (a store that never had the gateway's) the links are plain
    hashes, and entries without one before the first are from before the chain began (named, not counted as
    altered).  A log where no entry verifies is not intact."""
    result = Verification(subject=f"audit log of organization {org_id}")
    previous, good, legacy, linked = GENESIS, 0, 0, True  # linked: the entry before is a link (or there is none)
    loose: list[str] = []  # entries that are not links: no hash, or (with a key) one made without it
    # with a key: the oldest entries, while they are plain-hash links from the start (anchored by a keyed successor)
    prekey: list[str] | None = [] if key is not None else None
    for row in rows:
        result.entries += 1
        stored, expected = row["hash"], audit_hash(row["prev_hash"], row, key)
        if stored != expected:
            if (prekey is not None and stored and row["prev_hash"] == previous
                    and audit_hash(row["prev_hash"], row) == stored):
                prekey.append(row["id"])  # a plain-hash link in the run from the start: anchored, or not, later
                previous = stored
                continue
            if prekey:  # the run ends without a keyed entry chaining to it: none of it proves anything
                loose.extend(prekey)
                linked = False
            prekey = None
            if key is None and not stored and not good and not loose:  # written before the chain began
                legacy += 1
                continue
            if not stored or key is not None and audit_hash(row["prev_hash"], row) == stored:
                loose.append(row["id"])
            else:
                result.problem(f"entry {row['id']}: it was altered")
            previous, linked = stored, False
            continue
        if prekey:
            good += len(prekey)  # this keyed entry chains to the run of plain-hash links (checked below)
        prekey = None
        if row["prev_hash"] == previous:
            good += 1
        elif row["prev_hash"] == GENESIS and not linked:
            result.problem(f"entry {row['id']}: the chain starts again here: the entries before it are not its links")
        else:
            result.problem(f"entry {row['id']}: does not chain to the entry before it (one was removed or inserted)")
        previous, linked = stored, True
    if prekey:  # plain-hash links to the end, and no keyed entry after them
        loose.extend(prekey)
    result.links = result.entries - legacy - len(loose)
    result.chain_head = previous
    if loose:
        how = "no hash, or one made without the gateway's key" if key is not None else "no hash"
        result.problem(f"{len(loose)} entries are not links of the chain ({how}: written before the chain was keyed, "
                       f"or stripped or re-computed since): {loose[0]}{f' ... {loose[-1]}' if len(loose) > 1 else ''}")
    if result.entries and not good:
        result.problem(f"none of its {result.entries} entries verifies: their hashes were removed, or re-computed "
                       "without the gateway's key")
    if legacy:
        result.problems.append(f"{legacy} entries from before the chain began cannot be verified (not counted as "
                               "altered)")
    return result
