"""The type checker holds: mypy, strict, over the core ([tool.mypy] in pyproject.toml).

Annotations and type-only imports are checked, not decoration: a wrong argument, an Optional used as
if it were set, a layer reached through a type that names it (docs/architecture.md) fail the suite.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_core_type_checks(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
