"""Tamper evidence for recordings and the audit log: hash chains, a signed seal, and their verification.

A session's events are stored in batches; each batch's hash covers the previous batch's hash and
every event of the batch (sequence number, offset, kind, bytes), so the last hash -- the session's
``chain_head`` -- stands for the whole recording. At close the gateway signs a seal statement (the
session id, the chain head, how many events and bytes, the exit code and end date) with its own
Ed25519 key, which is sealed at rest by the master key. Altering, removing, reordering or adding an
event, or changing the closing fields, breaks the chain or the seal; rewriting the whole chain also
needs the key.

The audit log is chained per organization the same way, one entry a link. Pure functions and one
key holder; the store keeps the links, ``verify_*`` re-computes them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gatewayd.models import CHAIN_GENESIS as GENESIS
from gatewayd.models import SessionEvent

if TYPE_CHECKING:
    from gatewayd.store import Store
SEAL_KEY_NAME = "recording-seal"
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
    """What the seal signs: the recording's last hash and the session's closing facts."""
    return "\n".join(("gatewayd-seal-v1", session_id, chain_head, str(events), str(event_size),
                      "" if exit_code is None else str(exit_code), end_date or "")).encode()


def audit_hash(previous: str, row: dict[str, Any]) -> str:
    """The hash of one audit entry as stored (``request_payload_redacted`` as its JSON text)."""
    canonical = json.dumps([row.get(name) for name in _AUDIT_FIELDS], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(b"gatewayd-audit-v1\0" + previous.encode() + canonical.encode()).hexdigest()


class Sealer:
    """Signs and checks seals with the gateway's recording key (Ed25519)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self._public = private_key.public_key()

    @classmethod
    async def load(cls, store: Store) -> "Sealer":
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


def verify_recording(session_id: str, status: str, chain_head: str, seal: str | None, event_size: int,
                     exit_code: int | None, end_date: str | None, links: Sequence[BatchLink],
                     events: Sequence[tuple[int, SessionEvent]], sealer: Sealer) -> Verification:
    """Re-compute a session's chain from its stored events and check the seal. ``events``: (seq, event)."""
    result = Verification(subject=f"session {session_id}", links=len(links), entries=len(events))
    if not chain_head:
        result.problem("recorded before this gateway chained recordings: it cannot be verified")
        return result
    late_links = [link for link in links if link.first_seq >= LATE_BASE]
    links = [link for link in links if link.first_seq < LATE_BASE]
    late_events = [pair for pair in events if pair[0] >= LATE_BASE]
    events = [pair for pair in events if pair[0] < LATE_BASE]
    by_seq = dict(events)
    if len(by_seq) != len(events):
        result.problem("two events have the same sequence number")
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
    extra = sorted(seq for seq in by_seq if seq >= expected_seq)
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
        statement = seal_statement(session_id, chain_head, len(events), event_size, exit_code, end_date)
        if not sealer.valid(statement, seal):
            result.problem("the seal does not match: the recording or its closing fields were changed after close")
    elif status == "done":
        result.problem("the session is done but has no seal")
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


def verify_audit(org_id: str, rows: Iterable[dict[str, Any]]) -> Verification:
    """Re-compute an organization's audit chain from its stored entries, oldest first."""
    result = Verification(subject=f"audit log of organization {org_id}")
    previous, chained, legacy = GENESIS, False, 0
    for row in rows:
        result.entries += 1
        if not row["hash"] and not chained:  # written before this gateway chained its audit log
            legacy += 1
            continue
        chained = True
        if row["prev_hash"] != previous:
            result.problem(f"entry {row['id']}: does not chain to the entry before it (one was removed or inserted)")
        if audit_hash(row["prev_hash"], row) != row["hash"]:
            result.problem(f"entry {row['id']}: it was altered")
        previous = row["hash"]
    result.links = result.entries - legacy
    result.chain_head = previous
    if legacy:
        result.problems.append(f"{legacy} entries from before the chain began cannot be verified (not counted as "
                               "altered)")
    return result
