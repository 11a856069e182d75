#!/usr/bin/env bash
# Run the whole suite once per supported Python, each in a venv of its own (.venv-3.X), through the
# same `make test` recipe as the default Python. A version with no interpreter here is reported as not
# run (REQUIRE_ALL=1 makes that a failure); the summary says which versions ran and how they ended.
#
#   PYTHONS="3.11 3.12 3.13"  the versions to run (default: the ones pyproject.toml's classifiers name)
#   PYTEST_ARGS=...           passed to every run, as with `make test`
set -uo pipefail
cd "$(dirname "$0")/.."
make=${MAKE:-make}
pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
versions=${PYTHONS:-$(sed -n 's/^ *"Programming Language :: Python :: \(3\.[0-9][0-9]*\)",*$/\1/p' pyproject.toml)}
if [ -z "$versions" ]; then
  echo "test-matrix: no Python versions to run (set PYTHONS or the classifiers in pyproject.toml)" >&2
  exit 2
fi

# The interpreter for version $1: the newest pyenv release build (pyenv_root/versions/3.X.N), else python3.X
# on PATH; a candidate counts only if it runs and reports that version (a pyenv shim of an inactive
# version does not).
find_python() {
  local version=$1 dir candidate
  local candidates=()
  while IFS= read -r dir; do
    [[ $(basename "$dir") =~ ^${version//./\\.}\.[0-9]+$ ]] && candidates+=("$dir/bin/python3")
  done < <(ls -d "$pyenv_root/versions/$version".* 2>/dev/null | sort -V -r)
  candidate=$(command -v "python$version" 2>/dev/null) && candidates+=("$candidate")
  for candidate in "${candidates[@]}"; do
    if [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$version" ]; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

summary=()
ran=0 failed=0 missing=0
for version in $versions; do
  if ! python=$(find_python "$version"); then
    summary+=("$version  NOT RUN: no Python $version here ($pyenv_root/versions/$version.*, python$version on PATH)")
    missing=$((missing + 1))
    continue
  fi
  full=$("$python" -c 'import platform; print(platform.python_version())')
  echo "=== test-matrix: Python $full ($python) in .venv-$version ==="
  ran=$((ran + 1))
  if "$make" --no-print-directory test PYTHON="$python" VENV=".venv-$version"; then
    summary+=("$version  passed   (Python $full, $python)")
  else
    summary+=("$version  FAILED   (Python $full, $python)")
    failed=$((failed + 1))
  fi
done

echo "=== test-matrix summary: $ran run, $failed failed, $missing not run ==="
printf '  %s\n' "${summary[@]}"
if [ "$failed" -gt 0 ] || [ "$ran" -eq 0 ]; then
  exit 1
fi
if [ "$missing" -gt 0 ] && [ "${REQUIRE_ALL:-0}" = 1 ]; then
  echo "test-matrix: REQUIRE_ALL=1 and $missing version(s) not run" >&2
  exit 1
fi
