"""The clipboard channel (``cliprdr``) where the connection allows it: its text only, through the session's policy.

A side that copies announces its formats (a format list); the other side asks
for one (a data request) and the owner answers with the data (a data
response). The gateway reads each message with pyrdp's ``ClipboardParser``
and lets only text pass, by format number (names are not read: a number below
``0xC000`` is a predefined format whatever its name):

* a format list goes on with its text formats only (``CF_UNICODETEXT``,
  ``CF_TEXT``, ``CF_OEMTEXT``); every other one (a file list, an image, rich
  text, any registered format) is refused;
* a data request goes on only for a text format its owner announced (else it
  is answered with a failure, as an owner without it would);
* the data is decoded (UTF-16LE; ``CF_TEXT`` and ``CF_OEMTEXT`` in ASCII
  only, their code page being unknown), up to its first NUL, as the reader
  takes it, and sent on re-encoded from what was read: the client's paste is
  the session's input (recorded as ``i``, read by the input rules; refused,
  the target gets a failure), the target's its output (``o``, checked and
  masked by the output rules; what cannot be masked back into its format, or
  is blocked, is withheld: the client gets a failure);
* file streams (contents requests and responses, locks) and any other
  message carry nothing across.

Each refusal is told to ``refuse`` (the proxy's ``e`` event and audit entry).
The long format names of every current client and server are assumed (the
parser reads no short ones): a list the parser mis-reads still gives only
numbers, and only the numbers of text pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from pyrdp.enum import ClipboardMessageFlags, ClipboardMessageType, ParserMode
from pyrdp.layer import ClipboardLayer, LayerChainItem, VirtualChannelLayer
from pyrdp.parser import ClipboardParser
from pyrdp.pdu import ClipboardPDU, FormatDataRequestPDU, FormatDataResponsePDU, FormatListPDU

if TYPE_CHECKING:
    from gatewayd.guardrails import GuardVerdict
    from gatewayd.policy import SessionPolicy

CF_TEXT, CF_OEMTEXT, CF_UNICODETEXT = 1, 7, 13
TEXT_FORMATS = {CF_UNICODETEXT: "CF_UNICODETEXT", CF_TEXT: "CF_TEXT", CF_OEMTEXT: "CF_OEMTEXT"}
CLIENT, TARGET = "client", "target"
# what carries nothing across: file streams, their locks, the client's temporary directory for files
REFUSED_MESSAGES = {ClipboardMessageType.CB_FILECONTENTS_REQUEST: "file contents request",
                    ClipboardMessageType.CB_FILECONTENTS_RESPONSE: "file contents",
                    ClipboardMessageType.CB_LOCK_CLIPDATA: "clipboard lock",
                    ClipboardMessageType.CB_UNLOCK_CLIPDATA: "clipboard unlock",
                    ClipboardMessageType.CB_TEMP_DIRECTORY: "temporary directory for files"}
FORMAT_REFUSED = ("the {side}'s clipboard {formats} refused: the gateway lets only clipboard text pass "
                  "(settings.rdp.clipboard), which it records")
MESSAGE_REFUSED = "the {side}'s clipboard {what} refused: the gateway lets only clipboard text pass"
UNREADABLE = ("the {side}'s clipboard text refused: {why}; the gateway passes only text it can read and record")
WITHHELD = "the target's clipboard text withheld: {why}"


def format_name(number: int, name: Any) -> str:
    """How a refusal names a format: its name (a registered format's) or its number."""
    try:
        text = str(name).strip()
    except Exception:  # a name that is not UTF-16LE: the number says it
        text = ""
    return f'"{text}"' if text else f"number {number}"


def formats(names: list[str]) -> str:
    """``format X`` or ``formats X, Y``: what a refusal names."""
    return ("format " if len(names) == 1 else "formats ") + ", ".join(names)


def decode(number: int, data: bytes) -> str:
    """The text of a text format's data, up to its first NUL; ValueError when it is not text the gateway reads."""
    if number == CF_UNICODETEXT:
        if len(data) % 2:
            data = data[:-1] if data[-1:] == b"\x00" else data  # a trailing odd NUL byte, as some clients pad
        text = data.decode("utf-16-le")  # UnicodeDecodeError is a ValueError
    else:
        text = data.decode("ascii")  # CF_TEXT, CF_OEMTEXT: a code page the gateway does not know, beyond ASCII
    return text.split("\x00", 1)[0]


def encode(number: int, text: str) -> bytes:
    """``text`` as a text format's data, NUL-terminated; ValueError when that format cannot hold it."""
    if number == CF_UNICODETEXT:
        return (text + "\x00").encode("utf-16-le", "strict")
    return (text + "\x00").encode("ascii")


class ClipboardText:
    """The relay of one session's clipboard channel: text formats only, each text through the policy.

    ``policy``: the session's chain (None before the session is open: then nothing passes); ``refuse``: a
    refusal's ``e`` event and audit entry; ``blocked``: a rule's verdict (its ``e`` event and audit entry).
    """

    def __init__(self, client: Any, server: Any, *, use_tls: bool, security: Callable[[ParserMode], Any],
                 policy: Callable[[], SessionPolicy | None], refuse: Callable[[str], None],
                 blocked: Callable[[GuardVerdict], None]) -> None:
        parser = ClipboardParser()  # one per session, both sides (pyrdp's default is one for the whole process)
        self.layers = {CLIENT: ClipboardLayer(parser), TARGET: ClipboardLayer(parser)}
        for side, channel, mode in ((CLIENT, client, ParserMode.SERVER), (TARGET, server, ParserMode.CLIENT)):
            chain = [channel] if use_tls else [channel, security(mode)]
            LayerChainItem.chain(*chain, VirtualChannelLayer(), self.layers[side])
        self.layers[CLIENT].createObserver(onPDUReceived=lambda pdu: self.received(CLIENT, pdu))
        self.layers[TARGET].createObserver(onPDUReceived=lambda pdu: self.received(TARGET, pdu))
        self.policy = policy
        self.refuse = refuse
        self.blocked = blocked
        self.offered: dict[str, set[int]] = {CLIENT: set(), TARGET: set()}  # each side's text formats, as announced
        self.pending: dict[str, int | None] = {CLIENT: None, TARGET: None}  # the format asked of each side

    @staticmethod
    def other(side: str) -> str:
        return TARGET if side == CLIENT else CLIENT

    def received(self, side: str, pdu: ClipboardPDU) -> None:
        """A message from ``side``: passed on, trimmed to text, or refused."""
        if isinstance(pdu, FormatListPDU):
            self.format_list(side, pdu)
        elif isinstance(pdu, FormatDataRequestPDU):
            self.data_request(side, pdu)
        elif isinstance(pdu, FormatDataResponsePDU):
            self.data_response(side, pdu)
        elif pdu.msgType in REFUSED_MESSAGES:
            self.refuse(MESSAGE_REFUSED.format(side=side, what=REFUSED_MESSAGES[pdu.msgType]))
        else:  # capabilities, monitor ready, a format list's acknowledgement: no content
            self.layers[self.other(side)].sendPDU(pdu)

    def format_list(self, side: str, pdu: FormatListPDU) -> None:
        text = {number: name for number, name in pdu.formatList.items() if number in TEXT_FORMATS}
        others = [format_name(number, name) for number, name in pdu.formatList.items() if number not in TEXT_FORMATS]
        if others:
            self.refuse(FORMAT_REFUSED.format(side=side, formats=formats(others)))
        self.offered[side] = set(text)
        self.pending[side] = None  # a new clipboard: an answer about the old one is not awaited
        self.layers[self.other(side)].sendPDU(FormatListPDU(text, pdu.msgFlags))

    def data_request(self, side: str, pdu: FormatDataRequestPDU) -> None:
        owner, number = self.other(side), int(pdu.requestedFormatId)
        if number not in self.offered[owner]:
            if number not in TEXT_FORMATS:
                self.refuse(FORMAT_REFUSED.format(side=owner, formats=formats([format_name(number, "")])))
            self.layers[side].sendPDU(FormatDataResponsePDU(b"", isSuccessful=False))
            return
        self.pending[owner] = number
        self.layers[owner].sendPDU(pdu)

    def data_response(self, side: str, pdu: FormatDataResponsePDU) -> None:
        reader, number = self.other(side), self.pending[side]
        self.pending[side] = None
        failed = FormatDataResponsePDU(b"", isSuccessful=False)
        if number is None:  # nothing was asked of it (or its clipboard changed since): nothing to pass
            self.refuse(MESSAGE_REFUSED.format(side=side, what="data nobody asked for"))
            return
        if not pdu.msgFlags & ClipboardMessageFlags.CB_RESPONSE_OK:  # the owner could not give it: say so
            self.layers[reader].sendPDU(failed)
            return
        policy = self.policy()
        try:
            text = decode(number, bytes(pdu.requestedFormatData))
        except ValueError:
            why = (f"its {TEXT_FORMATS[number]} is not ASCII (the code page is unknown)" if number != CF_UNICODETEXT
                   else "its CF_UNICODETEXT is not UTF-16LE")
            self.refuse(UNREADABLE.format(side=side, why=why))
            self.layers[reader].sendPDU(failed)
            return
        if policy is None:
            self.layers[reader].sendPDU(failed)
            return
        if side == CLIENT:
            verdict = policy.input(text)
            if verdict is not None:
                self.blocked(verdict)
                self.layers[reader].sendPDU(failed)
                return
            shown = text
        else:
            verdict, shown = policy.output_masked(text)
            if verdict is not None:
                self.blocked(verdict)
                self.layers[reader].sendPDU(failed)
                return
        try:
            data = encode(number, shown)
        except ValueError:  # the masked text does not fit the format (CF_TEXT): not shown unmasked
            self.refuse(WITHHELD.format(why=f"its masked text does not fit {TEXT_FORMATS[number]}"))
            self.layers[reader].sendPDU(failed)
            return
        self.layers[reader].sendPDU(FormatDataResponsePDU(data, isSuccessful=True, formatId=number))
