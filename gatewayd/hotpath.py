"""The hot path compiled: the per-message modules built with Cython from their unchanged Python source.

``make`` builds them in place (``python -m launcher.hotpath build``: one extension module beside each ``.py``).
The core's modules are listed here (``CORE_MODULES``); a protocol's are in its description (``compiled``),
passed in when it is registered (gatewayd.protocols calls ``add``): the core never names a proxy's module,
and the build runs from the launcher, which registers every protocol first.
Python imports an extension before a source of the same name, so a compiled module runs wherever it
was built; the finder that ``install`` puts first (from ``gatewayd/__init__``) imports the ``.py``
instead when ``GATEWAYD_PURE_PYTHON`` is set (the tests run the relay's suites and a daemon that way)
or when any hot-path source or ``.pxd`` is newer than any build (an edit not yet rebuilt never runs
stale code; the modules share typed classes, so they run compiled or from source together: ``runs``).  Without
a C compiler or Cython nothing is built and everything runs from source, as before.

Cython compiles these modules with ``annotation_typing=False``: type hints stay hints, so a compiled
module behaves as its source does (with them, a ``list`` hint refuses a tuple at run time).
docs/hotpath.md says why Cython and what was checked.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Sequence

PURE_ENV = "GATEWAYD_PURE_PYTHON"
# ``cython`` for a hot-path module that branches on ``cython.compiled`` (a C pass when compiled, Python's own
# expressions from source: gatewayd.languages, gatewayd.sql.pg_scan, proxies.postgres.messages), run as Python
# where Cython, a build-time dependency, is not installed. Compiled, the module's own ``import cython`` decides it.
NO_CYTHON = SimpleNamespace(compiled=False)

# What every message and recorded event goes through in the core; each protocol adds its own (``add``).
CORE_MODULES = (
    "gatewayd.agent.pump",
    "gatewayd.evidence",
    "gatewayd.guardrails",
    "gatewayd.languages",
    "gatewayd.masking",
    "gatewayd.patterns",
    "gatewayd.policy",
    "gatewayd.recording",
    "gatewayd.sql.pg_scan",
)
_ADDED: list[str] = []  # the registered protocols' modules, in registration order
_NAMES = set(CORE_MODULES)

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # this interpreter's, e.g. .cpython-311-x86_64-linux-gnu.so
DIRECTIVES = {"language_level": 3, "annotation_typing": False}


def pure_wanted() -> bool:
    """Whether ``GATEWAYD_PURE_PYTHON`` asks for the Python source of every hot-path module."""
    return os.environ.get(PURE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def paths(name: str) -> tuple[Path, Path]:
    """A hot-path module's source and the extension this interpreter would build of it."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py"), base.parent / (base.name + SUFFIX)


def choice(source: Path, extension: Path, pure: bool, shared: Sequence[Path] = ()) -> str:
    """``compiled`` when ``extension`` is built and not older than ``source`` nor any of ``shared`` (see
    ``shared_sources``) and ``pure`` is not asked, else ``python``."""
    if pure:
        return "python"
    try:
        built = extension.stat().st_mtime
        newest = max([source.stat().st_mtime] + [path.stat().st_mtime for path in shared if path.exists()])
    except OSError:
        return "python"
    return "compiled" if built >= newest else "python"


def shared_sources() -> list[Path]:
    """Every hot-path source and declaration file (``.pxd``): compiled modules use each other's typed classes
    (the ``.pxd`` beside a module declares them), so an edit to any of them makes every build stale, and
    the hot path then runs from source as one piece until it is built again."""
    found = [paths(name)[0] for name in modules()]
    return found + [path.with_suffix(".pxd") for path in found if path.with_suffix(".pxd").exists()]


def runs(pure: bool) -> str:
    """How the hot path runs, as one piece: ``compiled`` only when every module's build is fresh.

    Compiled modules import each other's typed classes, so a build left half done (one module failed to
    compile, the build was interrupted) must not run beside the source of another: then all run from source.
    """
    if pure:
        return "python"
    shared = shared_sources()
    fresh = all(choice(*paths(name), pure=False, shared=shared) == "compiled" for name in modules())
    return "compiled" if fresh else "python"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports a hot-path module from its ``.py`` where ``choice`` says so; leaves every other import alone."""

    def __init__(self, pure: bool) -> None:
        self.pure = pure

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _NAMES:
            return None
        source, _ = paths(fullname)
        if not source.exists() or runs(self.pure) == "compiled":
            return None  # the path's own finders: the extension first
        return importlib.util.spec_from_file_location(fullname, source)


def add(names: Sequence[str]) -> None:
    """Count a protocol's hot-path modules in (its description's ``compiled``, when it is registered).

    Registration comes before any of them is imported (importing ``proxies.<p>.relay`` imports ``proxies``,
    which registers every protocol first), so the finder knows them in time."""
    for name in names:
        if name not in _NAMES:
            _NAMES.add(name)
            _ADDED.append(name)


def modules() -> tuple[str, ...]:
    """Every hot-path module: the core's and those of each registered protocol."""
    return CORE_MODULES + tuple(_ADDED)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), before any hot-path module is imported."""
    if not any(isinstance(finder, _SourceFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder(pure_wanted()))


def loaded() -> dict[str, str]:
    """Each hot-path module imported so far: ``compiled`` or ``python`` (what ran, not what is on disk)."""
    found = {}
    for name in modules():
        module = sys.modules.get(name)
        if module is not None:
            origin = getattr(module, "__file__", "") or ""
            found[name] = "python" if origin.endswith(".py") else "compiled"
    return found


def summary() -> str:
    """``compiled``, ``python``, or which module runs how when they differ (the daemon logs it at start)."""
    kinds = loaded()
    if len(set(kinds.values())) == 1:
        return next(iter(kinds.values()))
    return ", ".join(f"{name}={kind}" for name, kind in kinds.items()) or "not loaded"


def build(jobs: int = 0) -> list[str]:
    """Compile every hot-path module in place (needs Cython and a C compiler); the names built.

    Nothing when every module is built and fresh; else all of them (see ``shared_sources``)."""
    from Cython.Build import cythonize  # a build-time dependency (the ``hotpath`` extra)
    from setuptools import Distribution, Extension

    if runs(pure=False) == "compiled":
        return []
    stale = list(modules())  # the typed classes' layouts may have changed: every module is built again
    extensions = [Extension(name, [str(paths(name)[0].relative_to(ROOT))]) for name in stale]
    cwd = os.getcwd()
    os.chdir(ROOT)  # setuptools places in-place builds relative to the working directory
    try:
        compiled = cythonize(  # type: ignore[no-untyped-call]
            extensions, compiler_directives=DIRECTIVES, build_dir="build/hotpath",
            nthreads=jobs or (os.cpu_count() or 1), quiet=True, force=True)
        distribution = Distribution({"name": "gatewayd-hotpath", "ext_modules": compiled})
        command = distribution.get_command_obj("build_ext")
        command.inplace = True
        command.parallel = jobs or (os.cpu_count() or 1)
        command.build_temp = "build/hotpath/temp"
        distribution.run_command("build_ext")
    finally:
        os.chdir(cwd)
    return stale


def main(argv: list[str]) -> int:
    """``build``, ``list`` (the modules a build compiles) or ``status``; launcher.hotpath runs it with every
    protocol registered (the Makefile: ``python -m launcher.hotpath build``)."""
    if argv[:1] == ["list"]:
        print("\n".join(modules()))
        return 0
    if argv[:1] == ["build"]:
        built = build()
        print("hot path: " + (f"compiled {', '.join(built)}" if built else "up to date"))
        return 0
    if argv[:1] == ["status"]:
        print(f"hot path: {runs(pure_wanted())}")
        return 0
    print("usage: python -m launcher.hotpath build | list | status", file=sys.stderr)
    return 2
