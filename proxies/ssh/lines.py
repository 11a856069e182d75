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
``EchoWatch`` reads both sides of a pty for the record: a line the target did
not echo (a password at its prompt) is recorded as a note, not as its keys.
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


# a prompt asking for a secret, ending the target's last output line: "Password: ", "[sudo] password for bob: "
_SECRET_PROMPT = re.compile(rb"(?i)(?:pass(?:word|phrase)|PIN|secret|token)[^\n]*[:?][ \t]*\Z")
_PROMPT_TAIL = 256  # bytes of the target's last output line kept for that question
_LINE_ENDS = b"\r\n\x03"  # Enter (CR, LF) and ^C end a line being typed
_KEYS_ONE_BY_ONE = re.compile(rb"[\r\n\x03\x1b\x7f\x08\x15]")  # line ends, ESC, erasures: read a key at a time
_NOT_ECHOED = bytes(range(0x20))  # control keys: not looked for in the echo
_NOT_COUNTED = bytes(range(0x20)) + bytes(range(0x80, 0xC0))  # nor counted (nor the rest of a UTF-8 character)


class EchoWatch:
    """What a pty shell's keystrokes look like on the record: a line the target did not echo is a secret.

    Under a pty the target echoes what is typed (the line discipline, readline); at a prompt that does not
    (``sudo``, ``passwd``, ``read -s``, ``mysql -p``, ``ssh`` to a further host) nothing comes back. So the
    keystrokes of each line are held off the record (``typed``) until the target's output since the line began
    holds its characters in that order (``output``; escape sequences and redraws may stand between them), then
    recorded as typed, and the rest of the line as it comes. A line that ended without that echo before the end of
    the target's next output line (the Enter's own echo), or at once when the target's last line asked for a
    secret (``Password:``), is recorded as ``[REDACTED: typed without echo, N characters]``. Pure and bounded: at
    most ``MAX_LINE`` bytes held (past that the line counts as not echoed); once a line's echo is seen its keys
    cost a flag and a search for a line end.
    """

    __slots__ = ("_held", "_chars", "_matched", "_count", "_echoed", "_silent", "_ended", "_after", "_tail",
                 "_escape", "_after_cr", "_prompted")

    def __init__(self) -> None:
        self._held = bytearray()  # the keystrokes of the line not yet on the record
        self._chars = bytearray()  # its printable bytes, which the echo must show in this order
        self._matched = 0  # how many of them the target's output showed so far
        self._count = 0  # characters in the line (erasures taken off), for the note
        self._echoed = False  # its echo was seen: its keys go on the record as typed
        self._silent = False  # taken as not echoed before its end (``silence``, a secret prompt, the size cap)
        self._ended = False  # its Enter was typed; the end of the target's next output line decides it
        self._after = bytearray()  # keystrokes typed after it, read once it is decided
        self._tail = b""  # the target's last output line (for the prompt)
        self._escape = 0  # 1: after ESC, 2: in a CSI sequence, 3: after ESC O
        self._after_cr = False
        self._prompted: bool | None = None  # the line began at a prompt asking for a secret (None: no key yet)

    def note(self) -> str:
        """What the record says instead of the line being typed."""
        return f"[REDACTED: typed without echo, {max(self._count, 0)} characters]"

    @property
    def echoed(self) -> bool | None:
        """The line being typed: True once its echo was seen (or it has no character to echo), False when taken
        as not echoed (silenced, or begun at a secret prompt and not echoed yet), None while it may still come."""
        if self._echoed or self._matched >= len(self._chars):
            return True
        return False if self._silent or self._prompted is True else None

    def silence(self) -> None:
        """The line being typed is taken as not echoed (its echo did not come in time)."""
        if self.echoed is None:
            self._silent = True

    def typed(self, data: bytes) -> list[bytes]:
        """Keystrokes the client sent; what goes on the record now, in order."""
        if self._ended:  # behind a line whose echo is still to be decided
            self._after += data
            return self._decide(False) if len(self._held) + len(self._after) > MAX_LINE else []
        if self._echoed and b"\r" not in data and b"\n" not in data and b"\x03" not in data:
            return [data]
        out: list[bytes] = []
        start = at = 0
        while at < len(data):
            if not self._escape:  # a stretch of plain keys at once (a paste is not read a byte at a time)
                found = _KEYS_ONE_BY_ONE.search(data, at)
                stop = len(data) if found is None else found.start()
                if stop > at:
                    self._plain(data[at:stop])
                    at = stop
                    continue
            byte = data[at]
            at += 1
            if byte in _LINE_ENDS:
                if byte == 0x0A and self._after_cr:  # CR LF: one line end, the LF kept with the next line
                    self._after_cr = False
                    continue
                self._after_cr = byte == 0x0D
                self._keep(out, data[start:at])
                start = at
                echoed = self.echoed
                if echoed is None:  # the target's next output line decides it
                    self._ended = True
                    self._after += data[start:]
                    return out
                out += self._end(echoed)
                continue
            self._after_cr = False
            if self._prompted is None:  # a line's first key: what the target asked before it
                self._prompted = _SECRET_PROMPT.search(self._tail) is not None
            escape = self._escape
            if escape == 1:
                self._escape = 2 if byte == 0x5B else 3 if byte == 0x4F else 0
            elif escape == 2:
                if 0x40 <= byte <= 0x7E:
                    self._escape = 0
            elif escape == 3:
                self._escape = 0
            elif byte == 0x1B:
                self._escape = 1
            elif byte in _ERASE_CHAR:
                self._count -= 1
            elif byte == 0x15:  # ^U
                self._count = 0
        self._keep(out, data[start:])
        if len(self._held) > MAX_LINE:
            self._silent = True
            del self._held[:-1]
        return out

    def output(self, data: bytes) -> list[bytes]:
        """The target's output (the terminal), before it is recorded; what of the input goes on the record first."""
        cut = data.rfind(b"\n")
        last = data[max(cut + 1, len(data) - _PROMPT_TAIL):]
        self._tail = last if cut >= 0 else (self._tail + last)[-_PROMPT_TAIL:]
        return self._match(data)

    def close(self) -> list[bytes]:
        """The channel ends: what is still held goes on the record, as a note where no echo was seen."""
        out: list[bytes] = []
        while self._ended:
            out += self._decide(False)
        if self._held:
            out.append(bytes(self._held) if self.echoed else self.note().encode())
            self._reset()
        return out

    # -- internals

    def _plain(self, keys: bytes) -> None:
        """Keys that are neither a line end, ESC nor an erasure: the characters the echo must show."""
        self._after_cr = False
        if self._prompted is None:
            self._prompted = _SECRET_PROMPT.search(self._tail) is not None
        if len(self._chars) < MAX_LINE:
            self._chars += keys.translate(None, _NOT_ECHOED)[:MAX_LINE - len(self._chars)]
        self._count += len(keys.translate(None, _NOT_COUNTED))

    def _keep(self, out: list[bytes], keys: bytes) -> None:
        if not keys:
            return
        if self._echoed:
            out.append(keys)
        elif self._silent:  # on the record as the note: only its last key (a line end) is kept
            self._held[:] = keys[-1:]
        else:
            self._held += keys

    def _match(self, data: bytes) -> list[bytes]:
        """Look for the held line's characters in ``data``; after its Enter, up to the end of an output line."""
        if self._echoed or self._silent or not self._held:
            return []
        chars, matched = self._chars, self._matched
        end = data.find(b"\n") if self._ended else -1
        limit = len(data) if end < 0 else end
        at = 0
        while matched < len(chars):
            at = data.find(chars[matched:matched + 1], at, limit)
            if at < 0:
                break
            run = 1  # what follows it matched as a run (an echo is mostly the keys as typed): fewer steps
            while run < 4096 and at + 2 * run <= limit and data[at:at + 2 * run] == chars[matched:matched + 2 * run]:
                run *= 2
            at += run
            matched += run
        self._matched = matched
        if matched >= len(chars):
            if not self._ended:
                self._echoed = True
                held = bytes(self._held)
                self._held.clear()
                return [held]
            return self._decide(True) + (self._match(data[at:]) if self._held else [])
        if end >= 0:  # the Enter's line ended without the echo
            return self._decide(False) + (self._match(data[end + 1:]) if self._held else [])
        return []

    def _decide(self, echoed: bool) -> list[bytes]:
        """The ended line is decided: on the record as typed or as the note; the keys typed after it are read."""
        after = bytes(self._after)
        out = self._end(echoed)
        return out + self.typed(after) if after else out

    def _end(self, echoed: bool) -> list[bytes]:
        held = bytes(self._held)
        out = ([held] if echoed else [self.note().encode() + held[-1:]]) if held else []
        self._reset()
        return out

    def _reset(self) -> None:
        self._held.clear()
        self._chars.clear()
        self._after.clear()
        self._matched = self._count = self._escape = 0
        self._echoed = self._silent = self._ended = False
        self._prompted = None
