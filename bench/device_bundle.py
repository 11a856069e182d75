"""Fit ``.bench-bundle/`` for the lent 16-core machine: what travels there is at most 64 MiB, compiled included.

``../shared/bench-machine/make-bundle.sh`` downloads a Python 3.12 wheel of every package in ``.venv``
(the test tools too: Playwright, moto...), well over that. This keeps what the daemon and the benchmarks
import, adds the hot path's extensions built for Python 3.12 (the lent machine's; the daemon runs from source
without them, which is not what is measured), and, with ``--baseline REV``, another commit's tree with its own
extensions, for ``bench_postgres.py --baseline`` (before and after in one run). On the lent machine
``bench/device_run.sh`` unpacks them and runs the benchmark.

    .venv/bin/python bench/device_bundle.py [--baseline REV]      # after make; about eight minutes
    # then, through the device tool (carry .bench-bundle):
    bash bench/device_run.sh postgres --clients 16 --seconds 4 --rounds 3 [--baseline .bench-bundle/before]

Needs a Python 3.12 here (pyenv's or ``python3.12``), a C compiler and ``strip``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.metadata
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".bench-bundle"
WHEELS = ROOT / ".bench-wheels"  # the trimmed wheels between runs (ignored by git; does not travel)
LIMIT = 64 * 1024 * 1024
# what the benchmarks import beside the daemon (tests/conftest.py imports pytest), and what `pip install -e .`
# needs without network
EXTRA = ("pytest", "setuptools")
# botocore's service descriptions the daemon uses (discovery) or may: the rest is most of its wheel
BOTOCORE_SERVICES = ("rds", "sts", "ec2", "secretsmanager", "iam")
LEFT_OUT_OF_BASELINE = ("tests", "docs", "console")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...]) -> set[str]:
    """The installed distributions ``roots`` need (no extras), as canonical names."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement, _, marker = line.partition(";")
            if "extra" in marker:
                continue
            todo.append(re.split(r"[\s<>=!~\[(]", requirement.strip(), maxsplit=1)[0])
    return seen


def lacking(wheels: Path) -> set[str]:
    """The installed distributions the daemon and the benchmarks need that ``wheels`` holds no wheel of: a
    dependency added since those wheels were fetched (their trimmed copy is kept between runs)."""
    have = {canonical(wheel.name.split("-", 1)[0]) for wheel in wheels.glob("*.whl")}
    needed = set()
    for name in closure(("gatewayd", *EXTRA)) - {"gatewayd"}:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (another platform's dependency): no wheel of it is expected
        needed.add(name)
    return needed - have


def python312() -> str:
    """A Python 3.12 interpreter here: pyenv's newest 3.12 build, else python3.12 on PATH."""
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(versions.glob("3.12.*/bin/python3"), reverse=True) if versions.is_dir() else []
    on_path = shutil.which("python3.12")
    for candidate in [*map(str, candidates), *([on_path] if on_path else [])]:
        try:
            version = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                     capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            continue
        if version == "True":
            return candidate
    sys.exit("device_bundle: no Python 3.12 here (pyenv install 3.12, or apt-get install python3.12-dev)")


def build_hot_path(python: str, tree: Path, wheels: Path) -> list[Path]:
    """``tree``'s hot path compiled for Python 3.12, beside its sources; the extensions made, one for every module
    the build lists (the core's subpackages' too: a module left out would have the whole hot path run from source
    on the lent machine, since it runs compiled only as one piece)."""
    with tempfile.TemporaryDirectory(prefix="gatewayd-py312-") as venv:
        subprocess.run([python, "-m", "venv", venv], check=True)
        # pglast: the launcher registers every protocol (their hot-path modules) before it builds, and
        # PostgreSQL's description imports its dialect
        subprocess.run([f"{venv}/bin/pip", "install", "-q", "--find-links", str(wheels),  # the index: a trimmed bundle
                        "cython", "setuptools", "pglast"], check=True)

        def hotpath(command: str) -> subprocess.CompletedProcess[str]:
            how = (["-m", "launcher.hotpath", command] if (tree / "launcher" / "hotpath.py").exists() else
                   ["-c", f'import sys; from gatewayd import hotpath; sys.exit(hotpath.main(["{command}"]))'])  # older
            return subprocess.run([f"{venv}/bin/python", *how], cwd=tree, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(tree), "GATEWAYD_PURE_PYTHON": ""})

        built = hotpath("build")
        if built.returncode:
            sys.exit(f"device_bundle: the hot path of {tree} did not build for 3.12:\n{built.stderr[-2000:]}")
        listed, status = hotpath("list"), hotpath("status")
    if listed.returncode or status.returncode:  # a tree from before ``list``: every extension under its packages
        return sorted(tree.glob("gatewayd/**/*.cpython-312-*.so")) + sorted(tree.glob("proxies/**/*.cpython-312-*.so"))
    if status.stdout.strip() != "hot path: compiled":
        sys.exit(f"device_bundle: the 3.12 hot path of {tree} would not run compiled ({status.stdout.strip()})")
    extensions = []
    for name in listed.stdout.split():
        module = tree.joinpath(*name.split("."))
        found = sorted(module.parent.glob(f"{module.name}.cpython-312-*.so"))
        if not found:
            sys.exit(f"device_bundle: no 3.12 extension of {name} in {tree}")
        extensions += found
    return extensions


def pack(tree: Path, files: list[Path], archive: Path, prefix: str = "") -> None:
    """``files`` (paths under ``tree``) as an xz tarball; extensions stripped of their debugging sections."""
    with tempfile.TemporaryDirectory(prefix="gatewayd-pack-") as stage:
        for path in files:
            target = Path(stage, prefix, path.relative_to(tree))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            if target.suffix == ".so":
                subprocess.run(["strip", "--strip-debug", str(target)], check=True)
        subprocess.run(["tar", "-C", stage, "-cJf", str(archive), "."], check=True)


def slim_botocore(wheel: Path) -> None:
    """The botocore wheel with only ``BOTOCORE_SERVICES``' descriptions (its RECORD kept true)."""
    kept = io.BytesIO()
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(kept, "w", zipfile.ZIP_DEFLATED) as out:
        names = [name for name in source.namelist()
                 if not (name.startswith("botocore/data/") and name.count("/") > 2
                         and name.split("/")[2] not in BOTOCORE_SERVICES)]
        for name in names:
            data = source.read(name)
            if name.endswith(".dist-info/RECORD"):
                rows = [row for row in csv.reader(io.StringIO(data.decode())) if row and row[0] in names]
                buffer = io.StringIO()
                csv.writer(buffer, lineterminator="\n").writerows(rows)
                data = buffer.getvalue().encode()
            out.writestr(name, data)
    wheel.write_bytes(kept.getvalue())


def pack_wheels(wheels: Path, archive: Path) -> None:
    """``wheels`` as one xz tarball of their stored (uncompressed) copies: xz over the files themselves packs
    about a quarter tighter than over each wheel's deflated members (37 MiB of wheels in 27)."""
    with tempfile.TemporaryDirectory(prefix="gatewayd-wheels-") as stage:
        (Path(stage) / "whl").mkdir()
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as source, \
                    zipfile.ZipFile(Path(stage, "whl", wheel.name), "w", zipfile.ZIP_STORED) as out:
                for member in source.infolist():
                    data = source.read(member)
                    stored = copy.copy(member)
                    stored.compress_type = zipfile.ZIP_STORED
                    out.writestr(stored, data)
        subprocess.run(f"tar -C {stage} -cf - whl | xz -9 -T2 > {archive}", shell=True, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="", help="also pack this commit's tree, built, as .bench-bundle/before")
    args = parser.parse_args()
    wheels = BUNDLE / "whl"
    if not wheels.is_dir() and WHEELS.is_dir() and (BUNDLE / "pgroot.tar.xz").is_file():
        WHEELS.rename(wheels)  # the last run's, trimmed
    if wheels.is_dir() and (missing := lacking(wheels)):
        print(f"the kept wheels lack {', '.join(sorted(missing))}: fetched again", flush=True)
        shutil.rmtree(wheels)
    if not wheels.is_dir():
        subprocess.run([str(ROOT.parent / "shared" / "bench-machine" / "make-bundle.sh")], check=True, cwd=ROOT)
    python = python312()
    print(f"hot path for Python 3.12 ({python}) ...", flush=True)
    pack(ROOT, build_hot_path(python, ROOT, wheels), BUNDLE / "hotpath312.tar.xz")
    (BUNDLE / "before.tar.xz").unlink(missing_ok=True)  # an earlier run's baseline is not this one's
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="gatewayd-baseline-") as scratch:
            tree = Path(scratch, "before")
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), args.baseline], cwd=ROOT, check=True)
            try:
                print(f"baseline {args.baseline}: hot path for Python 3.12 ...", flush=True)
                built = build_hot_path(python, tree, wheels)
                listed = subprocess.run(["git", "ls-files"], cwd=tree, capture_output=True, text=True, check=True)
                sources = [tree / name for name in listed.stdout.splitlines()
                           if name.split("/", 1)[0] not in LEFT_OUT_OF_BASELINE and (tree / name).is_file()]
                pack(tree, sources + built, BUNDLE / "before.tar.xz", prefix="before")
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    keep = closure(("gatewayd", *EXTRA))
    for wheel in wheels.glob("*.whl"):
        name = canonical(wheel.name.split("-", 1)[0])
        if name not in keep:
            wheel.unlink()
        elif name == "botocore":
            slim_botocore(wheel)
    print("wheels packed for the journey ...", flush=True)
    pack_wheels(wheels, BUNDLE / "whl.tar.xz")  # bench/device_run.sh unpacks it into whl/ for run-bench.sh
    shutil.rmtree(WHEELS, ignore_errors=True)
    wheels.rename(WHEELS)
    size = sum(path.stat().st_size for path in BUNDLE.rglob("*") if path.is_file())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree_size = sum((ROOT / name).stat().st_size for name in tracked.decode().split("\0") if (ROOT / name).is_file())
    verdict = "fits" if size + tree_size <= LIMIT else "TOO LARGE for the device tool's 64 MiB"
    print(f".bench-bundle: {size / 2**20:.1f} MiB, the tree {tree_size / 2**20:.1f} MiB: {verdict}")
    return 0 if size + tree_size <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
