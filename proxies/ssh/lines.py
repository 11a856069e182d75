"""Shell line assembly: what a user types into an SSH shell, cut into lines for the input guard rails.

No sockets here. ``ShellInput.feed`` turns the bytes a client sends on a shell
channel into ``Chunk``s (forward as they are) and ``Line``s (a completed line:
the proxy checks its text, then forwards ``line.allowed`` or ``line.refused``).

- With a pty, keystrokes go to the target as they are typed (the remote pty
  echoes them and line editing, tab completion, full-screen programs work);
  only the Enter key is held back until the line is checked. A refused line
  is erased on the target with ``^U`` (kill line) instead of being entered.
  The keys are applied to the assembled text as readline applies them (a
  cursor, kills and yanks, quoted keys: ``ShellInput``), best effort.
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

from gatewayd.shell_words import shell_readings

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


# a download's command, where it stands in the command line (a path, ``sudo``, ``sh -c '...'`` before it): what it
# writes is a file's bytes. scp's source end plain; rsync's sender (``--daemon``: the direction is chosen later) and
# git's upload-pack and upload-archive compressed (``rsync -z``, a pack's objects, a zip or tgz)
_DOWNLOAD = re.compile(
    r"(?:^|[\s;&|(`'\"/])(?:(?P<scp>scp)\s+(?:-\S+\s+)*-[A-Za-z]*f\b"
    r"|rsync(?=\s)(?=.*\s--server\b)(?=.*\s--(?:sender|daemon)\b)|git[- ]upload-(?:pack|archive)\b)")


def download(command: str) -> str | None:
    """Whether an exec command sends the client a file protocol's download: "plain" for ``scp -f`` (the file's
    bytes as they are, sized), "compressed" for ``rsync --server --sender`` (or ``--daemon``), ``git-upload-pack``
    and ``git-upload-archive`` (what they send may be zlib-compressed: no rule can read it); None otherwise. The
    command is read as typed and as bash reads its words (``rs''ync``, ``--rsync-path`` spelled so, runs rsync)."""
    for text in (command, *shell_readings(command)):
        found = _DOWNLOAD.search(text)
        if found is not None:
            return "plain" if found["scp"] else "compressed"
    return None


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
_NOT_TEXT = bytes(b for b in range(0x20) if b not in (0x09, 0x08))  # without a pty: control bytes not in the text
INTERRUPT_LINE = b"\x03"  # ^C: abandons a command continued over lines (``\``), which ^U would not erase
END_OF_LINE = b"\x05"  # ^E: to the end of the line, so that the ^U after it erases all of it
PASTE_START, PASTE_END = b"\x1b[200~", b"\x1b[201~"  # a bracketed paste, inside which ^U and ^C are text
_CSI_MOVES = {0x44: "left", 0x43: "right", 0x48: "home", 0x46: "end"}  # ESC [ D, C, H, F (and ESC O ...)
_CSI_TILDE = {b"1": "home", b"7": "home", b"4": "end", b"8": "end", b"3": "delete"}  # ESC [ n ~
_CONTROL = {0x01: "home", 0x05: "end", 0x02: "left", 0x06: "right", 0x04: "delete", 0x0B: "kill end",
            0x15: "kill start", 0x17: "kill word", 0x19: "yank", 0x14: "transpose", 0x03: "clear"}
_META = {0x62: "word left", 0x66: "word right", 0x64: "kill word right", 0x7F: "kill word back", 0x08: "kill word back"}


def _is_word(byte: int) -> bool:
    """A word character for the meta-key commands (alphanumeric, as readline's; any byte of a UTF-8 character)."""
    return byte >= 0x80 or chr(byte).isalnum()


class ShellInput:
    """Line assembly for one shell channel.

    With a pty, the text is edited as readline (bash's line editor, emacs keys) edits it: a cursor moved by the
    arrow, Home and End keys and ^A ^E ^B ^F and meta b/f, insertion at it, ^H/DEL, ^D/Delete, ^U (to the line's
    start), ^K, ^W, meta d and meta DEL, ^Y (the last text killed), ^T, ^C, and ^V (the next byte as it is). A
    line ending in an odd number of backslashes continues on the next one: the next line is read with it. Inside
    a bracketed paste (``ESC [200~`` ... ``ESC [201~``, which a terminal sends around pasted text once bash asked
    for it) a newline only adds a line to readline's buffer, run all at the next Enter: each pasted line is read
    as it ends, and a refused one erases the whole buffer: the paste is ended, the buffer erased and the paste
    begun again for the rest of it.
    """

    __slots__ = ("pty", "_line", "_cursor", "_escape", "_params", "_killed", "_held", "_after_cr", "_continued",
                 "_paste", "_buffered")

    def __init__(self, pty: bool) -> None:
        self.pty = pty
        self._line = bytearray()  # the text of the line being typed
        self._cursor = 0  # where the next character goes (pty)
        self._escape = 0  # 0: none, 1: after ESC, 2: inside a CSI sequence, 3: after ESC O, 4: after ^V
        self._params = bytearray()  # a CSI sequence's parameter bytes
        self._killed = b""  # the last text killed (^U ^K ^W), which ^Y puts back
        self._held = bytearray()  # without a pty: the raw bytes of the line being typed
        self._after_cr = False
        self._continued: str | None = None  # the text of a line that ended with a backslash, read with the next
        self._paste = False  # inside a bracketed paste
        self._buffered = False  # readline's buffer may hold pasted lines before this one

    @property
    def pending(self) -> str:
        """The line typed so far (not yet entered)."""
        return self._line.decode("utf-8", "replace")

    def feed(self, data: bytes) -> list[Chunk | Line]:
        """Split client data into what to forward now and lines to check."""
        if not self.pty:
            return self._feed_held(data)
        out: list[Chunk | Line] = []
        start = 0
        pty = self.pty
        for index, byte in enumerate(data):
            if (byte == 0x0A or (byte == 0x0D and pty)) and self._escape != 4:
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

    def _feed_held(self, data: bytes) -> list[Chunk | Line]:
        """``feed`` without a pty: whole lines, their text kept a stretch at a time (an exec's input may be a bulk
        upload: no Python step per byte but where a line reaches ``MAX_LINE``)."""
        out: list[Chunk | Line] = []
        start = at = 0
        while at < len(data):
            newline = data.find(b"\n", at)
            end = len(data) if newline < 0 else newline
            kept = data[at:end].translate(None, _NOT_TEXT)
            room = MAX_LINE - len(self._line)
            if len(kept) < room:
                self._line += kept
            else:  # the stretch fills the line: cut it right after its ``room``-th text byte (checked in pieces)
                cut = at + room
                if len(kept) != end - at:  # control bytes in it: the shortest prefix that holds ``room`` text bytes
                    low, high = cut, end
                    while low < high:
                        middle = (low + high) // 2
                        if len(data[at:middle].translate(None, _NOT_TEXT)) >= room:
                            high = middle
                        else:
                            low = middle + 1
                    cut = low
                self._line += kept[:room]
                out.append(self._line_end(out, data[start:cut], b""))
                start = at = cut
                continue
            if newline < 0:
                break
            out.append(self._line_end(out, data[start:newline], b"\n"))
            start = at = newline + 1
        self._flush(out, data[start:])
        return out

    def _flush(self, out: list[Chunk | Line], data: bytes) -> None:
        if not data:
            return
        if self.pty:
            out.append(Chunk(data))
        else:
            self._held += data

    def _line_end(self, out: list[Chunk | Line], before: bytes, terminator: bytes) -> Line:
        typed = self._line.decode("utf-8", "replace")
        continued, at_end = self._continued, self._cursor >= len(self._line)
        text = typed if continued is None else continued + typed
        trailing = len(typed) - len(typed.rstrip("\\"))
        self._continued = text[:-1] if trailing % 2 and terminator else None  # the shell joins the next line to it
        self._line.clear()
        self._cursor = 0
        self._escape = 0
        if self.pty:
            if before:
                out.append(Chunk(before))
            erase = (INTERRUPT_LINE if continued is not None else KILL_LINE if at_end and not self._buffered
                     else END_OF_LINE + KILL_LINE)
            refused = PASTE_END + erase + PASTE_START if self._paste else erase  # the paste goes on, erased
            self._buffered = self._paste and bool(terminator)  # a newline inside a paste runs nothing yet
            return Line(text, terminator, refused)
        held = bytes(self._held) + before + terminator
        self._held.clear()
        return Line(text, held, b"\n" if continued is not None else b"")  # a newline ends what was continued

    def _edit(self, byte: int) -> None:
        if not self.pty:
            if byte >= 0x20 or byte in (0x09, 0x7F, 0x08):
                self._line.append(byte)
            return
        escape = self._escape
        if escape == 4:  # ^V: the byte as it is
            self._escape = 0
            self._insert(bytes((byte,)))
        elif escape == 1:
            self._escape = 2 if byte == 0x5B else 3 if byte == 0x4F else 0  # ESC [ (CSI) or ESC O (SS3)
            self._params.clear()
            if byte in _META:
                self._apply(_META[byte])
        elif escape == 2:
            if 0x40 <= byte <= 0x7E:
                self._escape = 0
                params = bytes(self._params)
                if byte == 0x7E and params in (b"200", b"201"):
                    self._paste = params == b"200"
                action = _CSI_TILDE.get(params) if byte == 0x7E else _CSI_MOVES.get(byte)
                if action is not None:
                    self._apply(action)
            else:
                self._params.append(byte)
        elif escape == 3:
            self._escape = 0
            if byte in _CSI_MOVES:
                self._apply(_CSI_MOVES[byte])
        elif byte == 0x1B:
            self._escape = 1
        elif byte == 0x16:
            self._escape = 4
        elif byte in _ERASE_CHAR:
            self._kill(self._previous(self._cursor), self._cursor, keep=False)
        elif byte in _CONTROL:
            self._apply(_CONTROL[byte])
        elif byte >= 0x20 or byte == 0x09:
            self._insert(bytes((byte,)))

    def _apply(self, action: str) -> None:
        """One editing command of readline's at the cursor."""
        line, cursor = self._line, self._cursor
        if action == "home":
            self._cursor = 0
        elif action == "end":
            self._cursor = len(line)
        elif action == "left":
            self._cursor = self._previous(cursor)
        elif action == "right":
            self._cursor = self._next(cursor)
        elif action == "delete":
            self._kill(cursor, self._next(cursor), keep=False)
        elif action == "kill start":
            self._kill(0, cursor)
        elif action == "kill end":
            self._kill(cursor, len(line))
        elif action == "kill word":  # ^W: back to the previous whitespace
            start = cursor
            while start and line[start - 1] == 0x20:
                start -= 1
            while start and line[start - 1] != 0x20:
                start -= 1
            self._kill(start, cursor)
        elif action == "word left":
            self._cursor = self._word_start(cursor)
        elif action == "kill word back":
            self._kill(self._word_start(cursor), cursor)
        elif action in ("word right", "kill word right"):
            end = cursor
            while end < len(line) and not _is_word(line[end]):
                end += 1
            while end < len(line) and _is_word(line[end]):
                end += 1
            if action == "word right":
                self._cursor = end
            else:
                self._kill(cursor, end)
        elif action == "yank":
            self._insert(self._killed)
        elif action == "transpose" and cursor and len(line) > 1:  # the characters around the cursor swap
            at = min(cursor, len(line) - 1)
            line[at - 1], line[at] = line[at], line[at - 1]
            self._cursor = at + 1
        elif action == "clear":  # ^C abandons the line
            line.clear()
            self._cursor = 0

    def _word_start(self, cursor: int) -> int:
        line = self._line
        while cursor and not _is_word(line[cursor - 1]):
            cursor -= 1
        while cursor and _is_word(line[cursor - 1]):
            cursor -= 1
        return cursor

    def _insert(self, data: bytes) -> None:
        self._line[self._cursor:self._cursor] = data
        self._cursor += len(data)

    def _kill(self, start: int, end: int, keep: bool = True) -> None:
        """Remove ``start:end`` (kept for ^Y unless ``keep`` is false); the cursor goes to ``start``."""
        if end <= start:
            return
        if keep:
            self._killed = bytes(self._line[start:end])
        del self._line[start:end]
        self._cursor = start

    def _previous(self, at: int) -> int:
        """The start of the UTF-8 character before ``at``."""
        at = max(at - 1, 0)
        while at and (self._line[at] & 0xC0) == 0x80:
            at -= 1
        return at

    def _next(self, at: int) -> int:
        """The end of the UTF-8 character at ``at``."""
        line = self._line
        if at >= len(line):
            return at
        at += 1
        while at < len(line) and (line[at] & 0xC0) == 0x80:
            at += 1
        return at


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
