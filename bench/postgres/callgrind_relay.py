"""The relay's instructions per pgbench ``-S`` transaction, counted by callgrind inside the hot loop only.

``bench_relay.py``'s loop (both sides of the relay, two input rules, the recording on), run under
``valgrind --tool=callgrind --collect-atstart=no --toggle-collect=starmap_next``: a warm-up run, then
the loop twice through ``itertools.starmap``, so that collection is on only while the loop runs (no
imports, no set-up).  Instructions per transaction, inclusive of everything the loop calls; exact, so
one run per mode is enough.  ``--tree`` counts another checkout's relay under this harness (its hot
path compiled or not, as that tree is built: the figure says which ran); ``--keep DIR`` keeps the
callgrind files for ``callgrind_annotate --inclusive=yes``.

    .venv/bin/python bench/postgres/callgrind_relay.py [--modes simple,extended,prepared] [--n 3000]
        [--tree DIR] [--keep DIR]
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def inner(mode: str, n: int) -> None:
    """Inside valgrind: set up, warm up, then the counted loops."""
    sys.path.insert(0, str(HERE))
    import bench_relay  # noqa: PLC0415 (imports the tree's modules: after BENCH_TREE is set)

    from gatewayd import hotpath  # noqa: PLC0415

    go = bench_relay.prepare(mode, n)
    go()  # warm-up: caches, the verdict cache, the descriptions
    for _ in itertools.starmap(go, [(), ()]):
        pass
    relay = sys.modules["proxies.postgres.relay"].__file__
    print(f"hot path: {hotpath.summary()}, {Path(relay).relative_to(os.environ['BENCH_TREE'])} of the tree",
          file=sys.stderr)


def count(mode: str, n: int, tree: Path, keep: Path | None) -> tuple[float, str]:
    out = Path(keep or tempfile.mkdtemp()) / f"callgrind.{mode}.out"
    env = {**os.environ, "BENCH_TREE": str(tree), "PYTHONHASHSEED": "0"}
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=starmap_next",
         f"--callgrind-out-file={out}", sys.executable, __file__, "--inner", mode, "--n", str(n)],
        env=env, capture_output=True, text=True, check=True)
    ran = next((line for line in run.stderr.splitlines() if line.startswith("hot path:")), "hot path: ?")
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1]) / (2 * n), ran
    raise SystemExit(f"no total in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="simple,extended,prepared")
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--tree", type=Path, default=HERE.parents[1])
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--inner")
    args = parser.parse_args()
    if args.inner:
        inner(args.inner, args.n)
        return
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        figure, ran = count(mode, args.n, args.tree.resolve(), args.keep)
        print(f"{mode}: {figure:,.0f} instructions per transaction ({ran})", flush=True)


if __name__ == "__main__":
    main()
