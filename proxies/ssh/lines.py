"""Shell line assembly: what a user types into an SSH shell, cut into lines for the input guard rails.

No sockets here. ``ShellInput.feed`` turns the bytes a client sends on a shell
channel into ``Chunk``s (forward as they are) and ``Line``s (a completed line:
the proxy checks its text, then forwards ``line.allowed`` or ``line.refused``).

- With a pty, keystrokes go to the target as they are typed (the remote pty
  echoes them and line editing, tab completion, full-screen programs work);
  only the Enter key is held back until the line is checked. A refused line
  is erased on the target with ``^U`` (kill line) instead of being entered.
  Backspace, ``^U``, ``^W``, ``^C`` and escape sequences (arrow keys) are
  applied to the assembled text as a terminal line editor would, best effort.
- Without a pty (``ssh host < script``), whole lines are held until their
  newline and a refused line never reaches the target.

``OutputWatch`` is the output side: the target's stdout and stderr chunks
checked against the output rules (a rule set, or the session's policy chain).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gatewayd.guardrails import GuardVerdict, RuleSet
    from gatewayd.policy import SessionPolicy

OUTPUT_OVERLAP = 1024  # characters of an output chunk checked again with the next one
KILL_LINE = b"\x15"  # ^U: erases the current input line in a tty or readline
MAX_LINE = 64 * 1024  # a longer "line" is checked and passed on in pieces


# one simple command: a path of plain characters, arguments without anything a shell would run or redirect
_SIMPLE_ARGS = r"(?:[ \t]+[^\s;&|`$<>(){}\\]+)*[ \t]*\Z"  # (a newline would start a second command)
_STDIN_PROTOCOL = re.compile(
    r"[ \t]*(?:[\w.~/-]*/)?(?:(?P<sftp>sftp-server)|scp(?=.*\s-[A-Za-z]*[tf]\b)|rsync(?=.*\s--server\b)"
    r"|git-(?:upload-pack|receive-pack|upload-archive))" + _SIMPLE_ARGS)


def stdin_protocol(command: str) -> str | None:
    """What an exec command reads on its input when that is a file protocol's bytes, not commands: "sftp" for
    sftp-server (``sftp -s /usr/lib/openssh/sftp-server``), "data" for ``scp -t``/``-f``, ``rsync --server`` and
    git's pack commands; None for any other command (its input is read as a shell's)."""
    found = _STDIN_PROTOCOL.match(command)
    if found is None:
        return None
    return "sftp" if found["sftp"] else "data"


@dataclass(slots=True, frozen=True)
class Chunk:
    """Bytes to forward to the target unchanged."""

    data: bytes


@dataclass(slots=True, frozen=True)
class Line:
    """A completed line: ``text`` is what the guard rails check."""

    text: str
    allowed: bytes  # what to forward when the rules allow the line
    refused: bytes  # what to forward when they block it


_ERASE_CHAR = (0x7F, 0x08)
_ERASE_LINE = (0x15, 0x03)  # ^U kills the line, ^C abandons it
_ERASE_WORD = 0x17  # ^W


class ShellInput:
    """Line assembly for one shell channel."""

    __slots__ = ("pty", "_line", "_escape", "_held", "_after_cr")

    def __init__(self, pty: bool) -> None:
        self.pty = pty
        self._line = bytearray()  # the text of the line being typed
        self._escape = 0  # 0: none, 1: after ESC, 2: inside a CSI/SS3 sequence
        self._held = bytearray()  # without a pty: the raw bytes of the line being typed
        self._after_cr = False

    @property
    def pending(self) -> str:
        """The line typed so far (not yet entered)."""
        return self._line.decode("utf-8", "replace")

    def feed(self, data: bytes) -> list[Chunk | Line]:
        """Split client data into what to forward now and lines to check."""
        out: list[Chunk | Line] = []
        start = 0
        pty = self.pty
        for index, byte in enumerate(data):
            if byte == 0x0A or (byte == 0x0D and pty):
                if pty and byte == 0x0A and self._after_cr:  # CR LF from a pty client: one line end
                    self._after_cr = False
                    if index > start:
                        out.append(Chunk(data[start:index]))
                    out.append(Chunk(b"\n"))
                    start = index + 1
                    continue
                self._after_cr = byte == 0x0D
                out.append(self._line_end(out, data[start:index], bytes((byte,))))
                start = index + 1
                continue
            self._after_cr = False
            self._edit(byte)
            if len(self._line) >= MAX_LINE:
                out.append(self._line_end(out, data[start:index + 1], b""))
                start = index + 1
        self._flush(out, data[start:])
        return out

    def feed_eof(self) -> list[Chunk | Line]:
        """The client closed its input: a last unterminated line is checked too."""
        if self._line or self._held:
            return [self._line_end([], b"", b"")]
        return []

    # -- internals

    def _flush(self, out: list[Chunk | Line], data: bytes) -> None:
        if not data:
            return
        if self.pty:
            out.append(Chunk(data))
        else:
            self._held += data

    def _line_end(self, out: list[Chunk | Line], before: bytes, terminator: bytes) -> Line:
        text = self._line.decode("utf-8", "replace")
        self._line.clear()
        self._escape = 0
        if self.pty:
            if before:
                out.append(Chunk(before))
            return Line(text, terminator, KILL_LINE)
        held = bytes(self._held) + before + terminator
        self._held.clear()
        return Line(text, held, b"")

    def _edit(self, byte: int) -> None:
        line = self._line
        if self._escape == 1:
            self._escape = 2 if byte in (0x5B, 0x4F) else 0  # ESC [ (CSI) or ESC O (SS3)
            return
        if self._escape == 2:
            if 0x40 <= byte <= 0x7E:
                self._escape = 0
            return
        if byte == 0x1B:
            self._escape = 1
        elif byte in _ERASE_CHAR:
            if line and self.pty:
                while line and (line.pop() & 0xC0) == 0x80:  # a whole UTF-8 character
                    pass
            elif not self.pty:
                line.append(byte)
        elif byte in _ERASE_LINE and self.pty:
            line.clear()
        elif byte == _ERASE_WORD and self.pty:
            while line and line[-1] == 0x20:
                line.pop()
            while line and line[-1] != 0x20:
                line.pop()
        elif byte >= 0x20 or byte == 0x09:
            line.append(byte)


class OutputWatch:
    """The output rules over one channel's stdout and stderr, chunk by chunk.

    Each stream is decoded incrementally (a UTF-8 character split between two
    chunks is whole in the text checked), and the last ``OUTPUT_OVERLAP``
    characters of a stream are checked again with its next chunk, so a match
    may straddle two chunks.
    """

    __slots__ = ("rules", "_decoders", "_tails")

    def __init__(self, rules: RuleSet | SessionPolicy) -> None:
        self.rules = rules
        decoder = codecs.getincrementaldecoder("utf-8")
        self._decoders = (decoder("replace"), decoder("replace"))
        self._tails = ["", ""]

    def check(self, data: bytes, stream: int) -> GuardVerdict | None:
        """``stream``: 0 stdout, 1 stderr; the rules' verdict (a policy says None for allowed)."""
        text = self._decoders[stream].decode(data)
        tail = self._tails[stream]
        checked = tail + text if tail else text
        self._tails[stream] = checked[-OUTPUT_OVERLAP:]
        return self.rules.check_output(checked)
