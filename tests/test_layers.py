"""The layers hold: launcher > proxies | control > gatewayd, no upward import, no cycle ([tool.importlinter])."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_imports_only_point_down():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_core_does_not_register_or_start_protocols_by_itself():
    """Importing the core alone knows no protocol: the composition root (or a test) registers them."""
    code = ("import gatewayd.daemon, gatewayd.cli, gatewayd.config, gatewayd.protocols as p, sys; "
            "assert not any(m.split('.')[0] in ('proxies', 'control', 'launcher') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('proxies', 'control', 'launcher')); "
            "assert p.registered() == (), p.names()")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_module_of_the_core_is_in_a_layer():
    """A module of ``gatewayd`` named in no layer escapes the contract (import-linter checks only what is named)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["name"] == "gatewayd's own layers")
    named = {name.strip().removeprefix("gatewayd.") for layer in layers for name in layer.split(":")}
    core = ROOT / "gatewayd"
    modules = {p.stem for p in core.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in core.iterdir() if (p / "__init__.py").exists()}
    assert modules - named == set(), "modules in no layer of [tool.importlinter]"
