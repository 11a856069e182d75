"""The compiled hot path (gatewayd/hotpath.py): built by make, used where it is fresh, and the Python
source still passing the same suites.

The rest of the suite runs on whatever the checkout has: compiled after ``make test``.  Here the hot
path's modules' own suites (PostgreSQL codec and relay, HTTP messages, SSH lines, guard rails, masking,
evidence, the agents' tunnel streams) run again in a pytest of their own with ``GATEWAYD_PURE_PYTHON=1``
(every hot-path module from its ``.py``), and the golden-file tests (tests/test_recording_equivalence.py,
tests/test_http_recording_equivalence.py: the HTTP front end among them) run a daemon each way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import proxies  # noqa: F401  registers every protocol (and its hot-path modules)
from gatewayd import hotpath, protocols

ROOT = Path(__file__).resolve().parent.parent
STAMP = Path(sys.prefix) / ".hotpath-stamp"  # make's: written once every module compiled
# the suites of what the hot path holds, run once more from source
SUITES = ["tests/test_postgres_codec.py", "tests/test_postgres_relay.py", "tests/test_masking.py",
          "tests/test_guardrails.py", "tests/test_evidence.py", "tests/test_http_messages.py",
          "tests/test_ssh_logic.py", "tests/test_tunnel_transport.py",
          "tests/test_hotpath.py::test_modules_run_as_the_switch_says"]


def imported_kinds(env: dict[str, str]) -> dict[str, str]:
    """Every hot-path module imported by a fresh interpreter with ``env``: compiled or python."""
    code = ("import json, importlib, proxies, gatewayd.hotpath as h; "
            "[importlib.import_module(n) for n in h.modules()]; print(json.dumps(h.loaded()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120, check=True)
    return json.loads(done.stdout)


def test_each_protocol_names_its_own_hot_path_modules_and_the_build_lists_them():
    """The core lists only its own modules; each protocol's come from its description (``compiled``), and the
    build (``python -m launcher.hotpath``, which registers every protocol) compiles both."""
    assert all(name.startswith("gatewayd.") for name in hotpath.CORE_MODULES)
    declared = [name for description in protocols.registered() for name in description.compiled]
    assert {"proxies.postgres.relay", "proxies.http.messages", "proxies.ssh.lines"} <= set(declared)
    for name in declared:
        assert hotpath.paths(name)[0].exists(), name
    listed = subprocess.run([sys.executable, "-m", "launcher.hotpath", "list"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=True).stdout.split()
    assert listed == list(hotpath.CORE_MODULES) + declared
    alone = subprocess.run([sys.executable, "-c", "from gatewayd import hotpath; hotpath.main(['list'])"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120, check=True).stdout.split()
    assert alone == list(hotpath.CORE_MODULES)  # the core by itself knows no proxy's module


def test_an_extension_is_used_only_when_fresh_and_not_switched_off(tmp_path):
    source, extension = tmp_path / "relay.py", tmp_path / ("relay" + hotpath.SUFFIX)
    source.write_text("x = 1\n")
    assert hotpath.choice(source, extension, pure=False) == "python"  # nothing built
    extension.write_bytes(b"\0")
    os.utime(source, (1_000, 1_000))
    os.utime(extension, (2_000, 2_000))
    assert hotpath.choice(source, extension, pure=False) == "compiled"
    assert hotpath.choice(source, extension, pure=True) == "python"  # GATEWAYD_PURE_PYTHON
    os.utime(source, (3_000, 3_000))  # edited after the build: the source runs, never a stale build
    assert hotpath.choice(source, extension, pure=False) == "python"
    os.utime(source, (1_000, 1_000))
    declared = tmp_path / "codec.pxd"  # another module's typed classes, which this build was compiled against
    declared.write_text("cdef class Message:\n    pass\n")
    os.utime(declared, (1_500, 1_500))
    assert hotpath.choice(source, extension, pure=False, shared=[declared]) == "compiled"
    os.utime(declared, (3_000, 3_000))  # changed since: this build may disagree with it, so the source runs
    assert hotpath.choice(source, extension, pure=False, shared=[declared]) == "python"


def test_an_edit_to_any_hot_path_source_or_declaration_counts_for_every_module():
    shared = hotpath.shared_sources()
    for name in hotpath.modules():
        source, _ = hotpath.paths(name)
        assert source in shared
        if source.with_suffix(".pxd").exists():
            assert source.with_suffix(".pxd") in shared
    assert any(path.suffix == ".pxd" for path in shared)  # the typed classes (codec, relay, session...)


def test_a_build_left_half_done_runs_from_source_as_a_whole(tmp_path, monkeypatch):
    """Modules compiled against each other's classes never run beside another's source: one stale or
    missing build (a module that failed to compile) and every module runs from source."""
    package = tmp_path / "pkg"
    package.mkdir()
    monkeypatch.setattr(hotpath, "ROOT", tmp_path)
    monkeypatch.setattr(hotpath, "CORE_MODULES", ("pkg.codec",))
    monkeypatch.setattr(hotpath, "_ADDED", ["pkg.relay"])  # a protocol's, as its registration adds it
    for name in hotpath.modules():
        source, extension = hotpath.paths(name)
        source.write_text("x = 1\n")
        os.utime(source, (1_000, 1_000))
        extension.write_bytes(b"\0")
        os.utime(extension, (2_000, 2_000))
    assert hotpath.runs(pure=False) == "compiled"
    assert hotpath.runs(pure=True) == "python"
    os.utime(hotpath.paths("pkg.relay")[1], (500, 500))  # relay's build is older than the sources
    assert hotpath.choice(*hotpath.paths("pkg.codec"), pure=False) == "compiled"  # codec's own is fresh...
    assert hotpath.runs(pure=False) == "python"  # ...but it does not run beside relay's source
    hotpath.paths("pkg.relay")[1].unlink()  # never built
    assert hotpath.runs(pure=False) == "python"


def test_the_switch_reads_the_environment(monkeypatch):
    for value, pure in (("1", True), ("yes", True), ("", False), ("0", False), ("false", False)):
        monkeypatch.setenv(hotpath.PURE_ENV, value)
        assert hotpath.pure_wanted() is pure, value


def test_modules_run_as_the_switch_says():
    """In this very process (also run from source by the test below): what ran is what ``runs`` says."""
    for name in hotpath.modules():
        importlib.import_module(name)
    wanted = dict.fromkeys(hotpath.modules(), hotpath.runs(hotpath.pure_wanted()))
    assert hotpath.loaded() == wanted
    if hotpath.pure_wanted():
        assert set(wanted.values()) == {"python"}


def test_make_compiled_every_module_where_it_could():
    """Where Cython and a C compiler are at hand, make's build leaves every module compiled and used."""
    if importlib.util.find_spec("Cython") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no Cython or no C compiler here: the hot path runs from source")
    if hotpath.pure_wanted():
        pytest.skip(f"{hotpath.PURE_ENV} is set")
    sources = hotpath.shared_sources()
    if STAMP.exists() and max(p.stat().st_mtime for p in sources) > STAMP.stat().st_mtime:
        pytest.skip("a hot-path source changed since make built it (make hotpath)")
    assert STAMP.exists(), f"make did not build the hot path into {sys.prefix} (make hotpath says why)"
    env = {k: v for k, v in os.environ.items() if k != hotpath.PURE_ENV}
    assert imported_kinds(env) == dict.fromkeys(hotpath.modules(), "compiled")
    assert imported_kinds({**env, hotpath.PURE_ENV: "1"}) == dict.fromkeys(hotpath.modules(), "python")


def test_the_python_source_passes_the_hot_path_suites():
    """The suites of the hot path's modules (PostgreSQL, HTTP, SSH lines, guard rails, masking) once more,
    every module from source."""
    if hotpath.runs(pure=False) != "compiled":
        pytest.skip("nothing is compiled here: the whole suite already ran on the Python source")
    env = {**os.environ, hotpath.PURE_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUITES],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
