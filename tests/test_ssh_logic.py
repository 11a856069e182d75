"""Unit tests of the SSH proxy's socket-free parts: shell line assembly, SFTP observation, asciicast rendering."""

from __future__ import annotations

import itertools
import json
import logging
import struct
from unittest import mock

import pytest
from cryptography.exceptions import InvalidTag
from hypothesis import given, settings
from hypothesis import strategies as st

from control.asciicast import render_asciicast
from gatewayd.guardrails import RuleSet
from gatewayd.models import GuardRail, Session, SessionEvent
from proxies.ssh.lines import (END_OF_LINE, INTERRUPT_LINE, KILL_LINE, OUTPUT_OVERLAP, PASTE_END, PASTE_START, Chunk,
                               Line, OutputWatch, ShellInput, download, stdin_protocol)
from proxies.ssh.sftp import Request, SftpObserver, Unreadable, open_kind, status_packet
from proxies.ssh.target import TargetError, TargetSettings

# --------------------------------------------------------------------------- target settings


def test_target_settings_from_the_role_and_their_clear_errors():
    settings = TargetSettings.from_role({"HOST": " db.internal ", "PASS": "pw", "ALLOW_UNVERIFIED_PASSWORD": "true"})
    assert (settings.host, settings.port, settings.user) == ("db.internal", 22, "root")
    assert settings.options("c")["port"] == 22 and settings.options("c")["password"] == "pw"
    for role, error in [({"PASS": "pw"}, 'connection "c" has no HOST'),
                        ({"HOST": "h", "PASS": "pw"}, 'connection "c": its password is sent only to a target whose '
                         "key is pinned (HOST_KEY), or where the connection allows it (ALLOW_UNVERIFIED_PASSWORD)"),
                        ({"HOST": "h", "PORT": "22x", "PASS": "pw"}, 'connection "c": its PORT is not a port number'),
                        ({"HOST": "h", "PORT": "70000", "PASS": "pw"}, 'connection "c": its PORT is not a port number'),
                        ({"HOST": "h"}, 'connection "c" has neither PASS nor PRIVATE_KEY'),
                        ({"HOST": "h", "PRIVATE_KEY": "not a key"},
                         'connection "c": its PRIVATE_KEY is not a readable private key')]:
        try:
            TargetSettings.from_role(role).options("c")
        except TargetError as exc:
            assert str(exc) == error
        else:
            raise AssertionError(f"{role} was accepted")


def test_a_password_goes_only_to_a_pinned_host_key_and_through_an_agent_never_otherwise():
    """Issue 31: an agent (or anyone answering for the target) got the password of a role without HOST_KEY."""
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519")
    pinned = key.export_public_key().decode()
    role = {"HOST": "h", "PASS": "pw"}
    assert TargetSettings.from_role({**role, "HOST_KEY": pinned}).options("c", agent=True)["password"] == "pw"
    relaxed = TargetSettings.from_role({**role, "ALLOW_UNVERIFIED_PASSWORD": "yes"})
    assert relaxed.options("c")["password"] == "pw"  # direct, allowed by the role
    try:
        relaxed.options("c", agent=True)
    except TargetError as exc:  # through an agent the role cannot allow it
        assert str(exc) == 'connection "c": its password is sent only to a target whose key is pinned (HOST_KEY)'
    else:
        raise AssertionError("a password went unpinned through an agent")
    both = TargetSettings.from_role({**role, "PRIVATE_KEY": key.export_private_key().decode()})
    assert both.options("c", agent=True)["password"] is None and both.options("c")["password"] is None  # key only


# --------------------------------------------------------------------------- logs


def test_asyncssh_logs_never_show_the_user_name_which_may_be_the_secret(caplog):
    from asyncssh.logging import logger as asyncssh_logger

    from proxies.ssh.server import hide_user_names

    hide_user_names()
    hide_user_names()  # installed once
    assert sum(type(f).__name__ == "HideUserNames" for f in logging.getLogger("asyncssh").filters) == 1
    with caplog.at_level(logging.INFO, logger="asyncssh"):
        asyncssh_logger.info("Beginning auth for user %s", "xgw-topsecret")
        asyncssh_logger.info("Auth failed for user %s", "xgw-topsecret")
        asyncssh_logger.info("Opening SSH connection to %s", ("example.com", 22))
    assert "xgw-topsecret" not in caplog.text
    assert caplog.text.count("for user (hidden)") == 2 and "example.com, port 22" in caplog.text


# --------------------------------------------------------------------------- output rules


def output_watch(*words: str) -> OutputWatch:
    rail = GuardRail(id="1", org_id="o", name="secrets",
                     output={"rules": [{"type": "deny_words_list", "words": list(words)}]})
    return OutputWatch(RuleSet([rail]))


def test_output_match_straddling_two_chunks_is_caught():
    watch = output_watch("password")
    assert watch.check(b"x" * 5000 + b"the pass", 0).allowed
    assert not watch.check(b"word is hunter2", 0).allowed


def test_output_streams_are_watched_apart():
    watch = output_watch("password")
    assert watch.check(b"pass", 0).allowed
    assert watch.check(b"word", 1).allowed  # stderr does not continue stdout's text
    assert not watch.check(b"word", 0).allowed


def test_output_character_split_between_chunks_is_matched_whole():
    watch = output_watch("mot de passe: caf\u00e9")
    data = "mot de passe: caf\u00e9".encode()
    assert watch.check(data[:-1], 0).allowed  # the chunk ends inside the two bytes of the last character
    assert not watch.check(data[-1:], 0).allowed


def test_output_overlap_is_bounded():
    watch = output_watch("needle")
    assert watch.check(b"nee", 0).allowed
    assert watch.check(b"y" * (OUTPUT_OVERLAP * 4), 0).allowed
    assert len(watch._tails[0]) == OUTPUT_OVERLAP
    assert watch.check(b"dle", 0).allowed  # the start of the word is long gone


# --------------------------------------------------------------------------- shell lines


def lines_of(pieces: list) -> list[str]:
    return [p.text for p in pieces if isinstance(p, Line)]


def test_pty_keystrokes_pass_at_once_and_only_enter_is_held():
    shell = ShellInput(pty=True)
    assert shell.feed(b"ls -") == [Chunk(b"ls -")]
    assert shell.pending == "ls -"
    assert shell.feed(b"la\r") == [Chunk(b"la"), Line("ls -la", b"\r", KILL_LINE)]
    assert shell.pending == ""


def test_pty_line_editing_is_applied_to_the_checked_text():
    shell = ShellInput(pty=True)
    assert lines_of(shell.feed(b"rn\x7fm -rf /\r")) == ["rm -rf /"]
    assert lines_of(shell.feed(b"echo one two\x17three\r")) == ["echo one three"]
    assert lines_of(shell.feed(b"garbage\x15ls\r")) == ["ls"]
    assert lines_of(shell.feed(b"half\x03\r")) == [""]
    assert lines_of(shell.feed(b"ls\x1b[A\x1bOB -l\r")) == ["ls -l"]  # arrow keys are not text
    assert lines_of(shell.feed("caf\u00e9\x7fe\r".encode())) == ["cafe"]  # backspace removes a whole character


def test_pty_cursor_moves_kills_and_literal_keys_are_applied_as_readline_does():
    """The text bash runs is the text checked: typed at a moved cursor, put back by ^Y, quoted by ^V (each was
    checked as typed in order, without them: ``ouch x``, Home, ``t`` ran ``touch x`` unread)."""
    shell = ShellInput(pty=True)
    for keys, text in [(b"ouch x\x1b[Ht", "touch x"), (b"ouch x\x01t", "touch x"), (b"ouch x\x1bOHt", "touch x"),
                       (b"tuch x\x1b[D\x1b[D\x1b[D\x1b[D\x1b[D\x02\x06o", "touch x"),
                       (b"touch x\x1b[1~\x1b[4~ y", "touch x y"), (b"rm -rf /\x1b[D\x1b[D\x15echo", "echo /"),
                       (b"touch x\x01\x0b", ""), (b"touch\x17 /x\x01\x19", "touch /x"), (b"otuch\x01\x06\x14", "touch"),
                       (b"xtouch\x01\x04", "touch"), (b"xtouch\x01\x1b[3~", "touch"), (b"touch x; \x16\x15", "touch x; \x15"),
                       (b"echo a touch\x1bb\x1bd", "echo a "), (b"x touch\x1b\x7f", "x "), (b"one two\x1bbthe \x1bf!", "one the two!")]:
        lines = shell.feed(keys + b"\r")
        assert [piece.text for piece in lines if isinstance(piece, Line)] == [text], keys
    # a refused line is erased whole: from its end when the cursor was moved
    assert shell.feed(b"ouch\x01t\r")[-1] == Line("touch", b"\r", END_OF_LINE + KILL_LINE)


def test_a_line_ending_in_a_backslash_is_read_with_the_next_one():
    shell = ShellInput(pty=True)
    assert lines_of(shell.feed(b"tou\\\rch x\r")) == ["tou\\", "touch x"]
    assert shell.feed(b"echo \\\\\r")[-1] == Line("echo \\\\", b"\r", KILL_LINE)  # an even count: no continuation
    shell.feed(b"a\\\r")
    assert shell.feed(b"b\r")[-1] == Line("ab", b"\r", INTERRUPT_LINE)  # refused: ^C abandons the whole command
    shell = ShellInput(pty=False)
    assert shell.feed(b"tou\\\nch x\necho\n") == [Line("tou\\", b"tou\\\n", b""), Line("touch x", b"ch x\n", b"\n"),
                                                   Line("echo", b"echo\n", b"")]


def test_a_bracketed_paste_is_read_line_by_line_and_a_refused_line_erases_the_buffer_inside_it():
    """Inside ESC [200~ ... ESC [201~ readline takes ^U as text: a refused pasted line ends the paste, erases the
    buffer (the lines pasted before it too, which had not run) and begins the paste again."""
    shell = ShellInput(pty=True)
    pieces = shell.feed(b"\x1b[200~echo a\rtouch x\recho b\x1b[201~")
    lines = [piece for piece in pieces if isinstance(piece, Line)]
    assert [line.text for line in lines] == ["echo a", "touch x"]
    assert lines[0].refused == PASTE_END + KILL_LINE + PASTE_START
    assert lines[1].refused == PASTE_END + END_OF_LINE + KILL_LINE + PASTE_START  # "echo a" is in the buffer
    assert shell.feed(b"\r") == [Line("echo b", b"\r", END_OF_LINE + KILL_LINE)]  # run at Enter, with the paste
    assert shell.feed(b"ls\r")[-1] == Line("ls", b"\r", KILL_LINE)


def test_pty_cr_lf_is_one_line_and_pasted_lines_split():
    shell = ShellInput(pty=True)
    pieces = shell.feed(b"one\r\ntwo\rthree")
    assert lines_of(pieces) == ["one", "two"]
    assert Chunk(b"\n") in pieces and shell.pending == "three"


def test_without_pty_lines_are_held_until_their_newline():
    shell = ShellInput(pty=False)
    assert shell.feed(b"echo a") == []
    assert shell.feed(b"b\nrm x\n") == [Line("echo ab", b"echo ab\n", b""), Line("rm x", b"rm x\n", b"")]
    assert shell.feed(b"tail") == []
    assert shell.feed_eof() == [Line("tail", b"tail", b"")]


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=50))
def test_without_pty_every_byte_is_forwarded_exactly_once_when_allowed(data, cut):
    shell = ShellInput(pty=False)
    out = b""
    for start in range(0, len(data), cut):
        out += b"".join(p.allowed if isinstance(p, Line) else p.data for p in shell.feed(data[start:start + cut]))
    out += b"".join(p.allowed for p in shell.feed_eof())
    assert out == data


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=50), st.integers(min_value=1, max_value=20))
def test_without_pty_lines_are_cut_as_a_byte_at_a_time_would_cut_them(data, cut, max_line):
    """The held lines' fast path (a stretch at a time) gives the lines, texts and bytes of one byte at a time."""
    expected, line, held = [], bytearray(), bytearray()
    for byte in data:
        held.append(byte)
        if byte != 0x0A and (byte >= 0x20 or byte in (0x09, 0x08)):
            line.append(byte)
        if byte == 0x0A or len(line) >= max_line:
            expected.append((line.decode("utf-8", "replace"), bytes(held)))
            line.clear()
            held.clear()
    if line or held:
        expected.append((line.decode("utf-8", "replace"), bytes(held)))
    shell, got = ShellInput(pty=False), []
    with mock.patch("proxies.ssh.lines.MAX_LINE", max_line):
        for start in range(0, len(data), cut):
            got += [(p.text, p.allowed) for p in shell.feed(data[start:start + cut]) if isinstance(p, Line)]
        got += [(p.text, p.allowed) for p in shell.feed_eof() if isinstance(p, Line)]
    assert got == expected


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=50))
def test_with_pty_every_byte_is_forwarded_exactly_once_when_allowed(data, cut):
    shell = ShellInput(pty=True)
    out = b""
    for start in range(0, len(data), cut):
        out += b"".join(p.allowed if isinstance(p, Line) else p.data for p in shell.feed(data[start:start + cut]))
    assert out == data


def test_only_one_simple_command_of_a_file_protocol_has_its_input_pass_unread():
    for command, protocol in [("scp -t /tmp/x", "data"), ("scp -r -d -t -- /tmp/x", "data"), ("scp -pf /etc/x", "data"),
                              ("rsync --server -vlogDtpre.iLsfxCIvu . /tmp/x", "data"),
                              ("git-upload-pack '/srv/r.git'", "data"), ("/usr/lib/openssh/sftp-server", "sftp"),
                              ("sftp-server -l DEBUG3", "sftp")]:
        assert stdin_protocol(command) == protocol, command
    for command in ("sh", "bash -s", "scp host:a b", "rsync a b", "scp -t x; sh", "scp -t x\nsh", "scp -t x\n",
                    "scp -t $(sh)", "scp -t `sh`", "$(sh)/scp -t x", "sftp-server | sh", "sftp-server < /dev/null",
                    "scp -t x && sh", "FOO=1 scp -t x"):
        assert stdin_protocol(command) is None, command


def test_downloads_are_told_from_the_command_wherever_it_stands_in_it():
    """What ``_unreadable_download`` refuses under mask or output rules: scp's source end, rsync's sender or daemon,
    git's upload-pack and upload-archive, behind a path, ``sudo`` or ``sh -c`` too; not the upload ends."""
    for command, kind in [("scp -f /x", "plain"), ("/usr/bin/scp -r -p -f /x", "plain"),
                          ("rsync --server --sender -vlogDtprze.iLsfxCIvu . /tmp/x", "compressed"),
                          ("rsync --server --daemon .", "compressed"), ("sudo rsync --server --sender . /x", "compressed"),
                          ("git-upload-pack '/srv/r.git'", "compressed"), ("git upload-archive /r", "compressed"),
                          ("sh -c 'git-upload-pack /r'", "compressed"),
                          ("rs''ync --server --sender . /x", "compressed"),  # as bash reads them
                          ("r\\sync --server --sender . /x", "compressed"), ("git-upload-p\"a\"ck /r", "compressed"),
                          ("s'c'p -f /x", "plain")]:
        assert download(command) == kind, command
    for command in ("scp -t /x", "rsync --server -vlogDtpre.iLsfxCIvu . /tmp/x", "git-receive-pack '/r'", "rsync a b",
                    "rsyncd --server --sender", "echo hi"):
        assert download(command) is None, command


# --------------------------------------------------------------------------- sftp


def string(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def packet(kind: int, body: bytes) -> bytes:
    return struct.pack(">IB", len(body) + 1, kind) + body


def client(observer: SftpObserver, data: bytes) -> tuple[bytes, list, list]:
    """(bytes forwarded as they are, requests to check, records) of one client chunk."""
    pieces = observer.client(data)
    forwarded = b"".join(p for p in pieces if isinstance(p, bytes))
    return (forwarded, [p for p in pieces if isinstance(p, Request)], [p for p in pieces if isinstance(p, tuple)])


def test_sftp_transfers_and_operations_become_lines_and_checkable_requests():
    observer = SftpObserver()
    init = packet(1, struct.pack(">I", 3))
    assert client(observer, init) == (init, [], [])
    assert observer.server(packet(2, struct.pack(">I", 3))) == []
    # open for writing (a request the rules may refuse), two writes fed in awkward pieces, close
    opening = packet(3, struct.pack(">I", 1) + string(b"/tmp/f") + struct.pack(">I", 0x1A) + struct.pack(">I", 0))
    assert client(observer, opening) == (b"", [Request(1, "put /tmp/f", opening, deferred=True)], [])
    assert observer.server(packet(102, struct.pack(">I", 1) + string(b"h1"))) == []
    writes = b"".join(packet(6, struct.pack(">I", 2 + i) + string(b"h1") + struct.pack(">Q", i * 1000)
                             + string(b"x" * 1000)) for i in range(2))
    forwarded = b""
    for i in range(0, len(writes), 7):
        out, requests, records = client(observer, writes[i:i + 7])
        assert requests == [] and records == []
        forwarded += out
    assert forwarded == writes  # every byte, in order, once each packet is whole
    closing = packet(4, struct.pack(">I", 9) + string(b"h1"))
    assert client(observer, closing) == (closing, [], [("i", "put /tmp/f 2000 bytes")])
    # open for reading, one read answered with data
    client(observer, packet(3, struct.pack(">I", 10) + string(b"/etc/x") + struct.pack(">II", 1, 0)))
    observer.server(packet(102, struct.pack(">I", 10) + string(b"h2")))
    client(observer, packet(5, struct.pack(">I", 11) + string(b"h2") + struct.pack(">QI", 0, 32768)))
    observer.server(packet(103, struct.pack(">I", 11) + string(b"y" * 500)))
    assert client(observer, packet(4, struct.pack(">I", 12) + string(b"h2")))[2] == [("i", "get /etc/x 500 bytes")]
    # a failed remove is an error line
    remove = packet(13, struct.pack(">I", 13) + string(b"/nope"))
    assert client(observer, remove)[1] == [Request(13, "rm /nope", remove)]
    status = packet(101, struct.pack(">II", 13, 2) + string(b"No such file") + string(b""))
    assert observer.server(status) == [("e", "failed: rm /nope: No such file")]
    assert client(observer, packet(18, struct.pack(">I", 14) + string(b"/a") + string(b"/b")))[1][0].line == \
        "rename /a /b"


def test_sftp_an_open_that_can_read_is_a_get_as_sftp_server_opens_it():
    """Write-only only with WRITE without READ; READ with WRITE is a get and a put, recorded as both."""
    assert [open_kind(flags) for flags in (0x01, 0x02, 0x1A, 0x03, 0x04, 0x08, 0x10, 0x00)] == [
        "get", "put", "put", "get put", "get put", "get put", "get put", "get"]
    observer = SftpObserver()
    opening = packet(3, struct.pack(">I", 1) + string(b"/f") + struct.pack(">II", 0x03, 0))
    assert client(observer, opening)[1] == [Request(1, "get /f", opening, deferred=True, also="put /f")]
    observer.server(packet(102, struct.pack(">I", 1) + string(b"h")))
    client(observer, packet(5, struct.pack(">I", 2) + string(b"h") + struct.pack(">QI", 0, 100)))
    observer.server(packet(103, struct.pack(">I", 2) + string(b"r" * 7)))
    client(observer, packet(6, struct.pack(">I", 3) + string(b"h") + struct.pack(">Q", 7) + string(b"w" * 4)))
    assert client(observer, packet(4, struct.pack(">I", 4) + string(b"h")))[2] == [
        ("i", "get /f 7 bytes"), ("i", "put /f 4 bytes")]


def test_sftp_refusal_is_a_status_packet_and_waits_for_a_packet_boundary():
    observer = SftpObserver()
    answer = status_packet(7, "blocked")
    assert answer == packet(101, struct.pack(">II", 7, 3) + string(b"blocked") + string(b""))
    data = packet(103, struct.pack(">I", 5) + string(b"z" * 100))
    assert observer.server_at_boundary
    observer.server(data[:50])
    assert not observer.server_at_boundary
    observer.server(data[50:])
    assert observer.server_at_boundary
    client(observer, packet(13, struct.pack(">I", 7) + string(b"/x")))
    observer.refused(7)
    assert observer.server(packet(101, struct.pack(">II", 7, 2) + string(b"late") + string(b""))) == []


def test_sftp_large_write_payload_streams_through_and_garbage_ends_the_stream():
    observer = SftpObserver()
    client(observer, packet(3, struct.pack(">I", 1) + string(b"/big") + struct.pack(">II", 0x1A, 0)))
    observer.server(packet(102, struct.pack(">I", 1) + string(b"h")))
    big = packet(6, struct.pack(">I", 2) + string(b"h") + struct.pack(">Q", 0) + string(b"z" * 300_000))
    forwarded = b""
    for i in range(0, len(big), 65536):
        out, requests, records = client(observer, big[i:i + 65536])
        forwarded += out
        assert requests == [] and records == []
    assert forwarded == big
    assert client(observer, packet(4, struct.pack(">I", 3) + string(b"h")))[2] == [("i", "put /big 300000 bytes")]
    # a length the observer cannot follow (sftp-server reads a zero length its own way): nothing more passes
    after = packet(13, struct.pack(">I", 4) + string(b"/x"))
    for junk in (b"\xff\xff\xff\xff" + b"junk", b"\0\0\0\0" + after[4:]):
        observer = SftpObserver()
        assert observer.client(junk) == [Unreadable(f"packet length {struct.unpack('>I', junk[:4])[0]}")]
        assert observer.client(after) == []
    # a request that does not parse (a path longer than its packet) is not passed either
    observer = SftpObserver()
    pieces = observer.client(packet(13, struct.pack(">I", 5) + struct.pack(">I", 99) + b"/x") + after)
    assert len(pieces) == 1 and isinstance(pieces[0], Unreadable) and "does not parse" in pieces[0].reason


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(min_value=1, max_value=70_000), min_size=1, max_size=12).map(
    lambda cuts: [max(cut, 97) for cut in cuts[:-1]] + cuts[-1:]))  # at most one tiny cut per round
def test_sftp_stream_cut_anywhere_is_forwarded_whole_and_read_the_same(cuts):
    """Client bytes come out once each, in order; the target's answers give the same records however cut."""
    requests = packet(13, struct.pack(">I", 1) + string(b"/gone")) + b"".join(
        packet(6, struct.pack(">I", 2 + i) + string(b"h") + struct.pack(">Q", 0) + string(b"w" * size))
        for i, size in enumerate((10, 40_000, 70_000)))
    answers = (packet(103, struct.pack(">I", 5) + string(b"r" * 50_000))
               + packet(101, struct.pack(">II", 1, 2) + string(b"No such file") + string(b"")))
    observers = SftpObserver(), SftpObserver()
    forwarded, records = [b"", b""], [[], []]
    for side, sizes in enumerate((cuts, [len(requests)])):  # cut anywhere, then whole
        observer, at, sizes = observers[side], 0, itertools.cycle(sizes)
        while at < len(requests):
            size = next(sizes)
            forwarded[side] += b"".join(p.raw if isinstance(p, Request) else p
                                        for p in observer.client(requests[at:at + size]) if not isinstance(p, tuple))
            at += size
        at = 0
        while at < len(answers):
            size = next(sizes)
            records[side] += observer.server(answers[at:at + size])
            at += size
        assert observer.server_at_boundary
    assert forwarded == [requests, requests]
    assert records[0] == records[1] == [("e", "failed: rm /gone: No such file")]


# --------------------------------------------------------------------------- asciicast


def session(metrics: dict) -> Session:
    return Session(id="s1", org_id="o", user_id="u", user_email="ada@example.com", user_name="Ada",
                   connection="box", connection_id="c", resource_name="box", type="custom", subtype="ssh",
                   verb="connect", status="done", start_date="2026-01-02T03:04:05Z", metrics=metrics)


def test_asciicast_of_a_pty_session():
    events = [SessionEvent(0, "i", b"ls\r"), SessionEvent(120, "o", b"a  b\r\n$ "),
              SessionEvent(300, "o", "\u00e9".encode()[:1]), SessionEvent(301, "o", "\u00e9".encode()[1:]),
              SessionEvent(400, "e", b"blocked by a rule")]
    text = render_asciicast(session({"terminal": {"type": "xterm-256color", "width": 120, "height": 40}}), events)
    lines = [json.loads(line) for line in text.splitlines()]
    header = lines[0]
    assert header["version"] == 2 and (header["width"], header["height"]) == (120, 40)
    assert header["env"]["TERM"] == "xterm-256color" and header["timestamp"] == 1767323045
    assert lines[1:] == [[0.0, "i", "ls\r"], [0.12, "o", "a  b\r\n$ "], [0.301, "o", "\u00e9"],
                         [0.4, "o", "\r\nblocked by a rule\r\n"]]


def test_asciicast_of_an_exec_session_gets_crlf_and_a_default_size():
    events = [SessionEvent(0, "i", b"ls"), SessionEvent(5, "o", b"a\nb\n"), SessionEvent(6, "e", b"warn\n")]
    lines = [json.loads(line) for line in render_asciicast(session({}), events).splitlines()]
    assert (lines[0]["width"], lines[0]["height"]) == (80, 24)
    assert lines[2:] == [[0.005, "o", "a\r\nb\r\n"], [0.006, "o", "warn\r\n"]]


# --------------------------------------------------------------------------- AES-GCM packets (proxies/ssh/gcm.py)


@settings(max_examples=60)
@given(sizes=st.lists(st.integers(min_value=1, max_value=2048).map(lambda n: n * 16), min_size=1, max_size=6),
       wide=st.booleans(), invocation=st.sampled_from([0, 7, (1 << 64) - 2]))
def test_gateway_gcm_puts_on_the_wire_what_asyncssh_does_and_reads_it_back(sizes, wide, invocation):
    """Packet by packet, from an IV about to wrap too: the same bytes as asyncssh's own GCM shim, and each side
    decrypts the other's; a packet with one bit changed does not decrypt."""
    from asyncssh.encryption import GCMEncryption

    from proxies.ssh.gcm import GatewayGCM

    cipher = "aes256-gcm" if wide else "aes128-gcm"
    key = bytes(range(32 if wide else 16))
    iv = b"\x01\x02\x03\x04" + invocation.to_bytes(8, "big")
    theirs, ours = GCMEncryption.new(cipher, key, iv), GatewayGCM.new(cipher, key, iv)
    their_reader, our_reader = GCMEncryption.new(cipher, key, iv), GatewayGCM.new(cipher, key, iv)
    opener = GatewayGCM.new(cipher, key, iv)  # the data path's reading (proxies/ssh/datapath.py): open, step
    for seq, size in enumerate(sizes):
        header, packet = struct.pack(">I", size), bytes(range(256)) * (size // 256) + bytes(size % 256)
        packet_, mac = theirs.encrypt_packet(seq, header, packet)
        wire, none = ours.encrypt_packet(seq, header, packet)
        assert wire == packet_ + mac and none == b""
        first, rest, tag = wire[:16], wire[16:-16], wire[-16:]
        assert our_reader.decrypt_packet(seq, first, rest, 4, tag) == packet
        assert their_reader.decrypt_packet(seq, first, rest, 4, tag) == packet
        # opened twice at the same IV (a packet left to asyncssh is opened again there), then stepped past
        assert opener.open(memoryview(wire)[:4], memoryview(wire)[4:]) == packet == opener.open(wire[:4], wire[4:])
        opener.step()
    flipped = GatewayGCM.new(cipher, key, iv)
    wire, _ = GatewayGCM.new(cipher, key, iv).encrypt_packet(0, b"\0\0\0\x10", bytes(16))
    assert flipped.decrypt_packet(0, wire[:16], bytes([wire[16] ^ 1]) + wire[17:-16], 4, wire[-16:]) is None
    with pytest.raises(InvalidTag):
        GatewayGCM.new(cipher, key, iv).open(wire[:4], bytes([wire[4] ^ 1]) + wire[5:])
    assert GatewayGCM.new(cipher, key, iv).seal(b"\0\0\0\x10", bytes(16)) == wire[4:]


def test_gateway_gcm_is_what_asyncssh_builds_once_installed():
    from asyncssh import encryption

    from proxies.ssh import gcm

    before = {name: encryption._enc_params[name] for name in gcm.NAMES}
    try:
        assert gcm.install() and gcm.install()  # idempotent
        for name in gcm.NAMES:
            assert type(encryption.get_encryption(name, bytes(32 if b"256" in name else 16), bytes(12))) \
                is gcm.GatewayGCM
        assert type(encryption.get_encryption(b"aes128-ctr", bytes(16), bytes(16))) is not gcm.GatewayGCM
        gcm.uninstall()
        assert all(encryption._enc_params[name][0] is encryption.GCMEncryption for name in gcm.NAMES)
    finally:
        encryption._enc_params.update(before)
