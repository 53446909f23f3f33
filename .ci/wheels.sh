#!/usr/bin/env bash
# Build every wheel and sdist of the workspace into dist/, then, for mega-moe and mega-tp-layers
# each alone: a fresh venv, `uv pip install --find-links dist <package>`, and the package
# README's example run under torchrun. Fails loudly (one "CI wheels:" line naming what broke).
#
# torch comes through uv's cache at the version in uv.lock (hard links, well under a second);
# the mega packages are installed from the wheels just built, with their mega dependencies and
# nothing else of the workspace.
#
# Usage: bash .ci/wheels.sh            (from anywhere; needs uv and a synced .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "CI wheels: $*" >&2
  exit 1
}

start=$SECONDS
rm -rf dist
uv build --all-packages -o dist -q || fail "uv build --all-packages failed"
echo "CI wheels: built $(ls dist | wc -l) files in $((SECONDS - start)) s"

# Every wheel and sdist carries the license; no wheel registers a pytest plugin.
for d in packages/* apps/*; do
  cmp -s LICENSE "$d/LICENSE" || fail "$d/LICENSE differs from the root LICENSE (copy it again)"
done
for w in dist/*.whl; do
  # (whole listings into grep: `grep -q` closing a pipe early would fail it under pipefail)
  unzip -Z1 "$w" | grep '\.dist-info/licenses/LICENSE$' >/dev/null || fail "$w has no LICENSE"
  if unzip -p "$w" '*.dist-info/entry_points.txt' 2>/dev/null | grep pytest11 >/dev/null; then
    fail "$w registers a pytest11 entry point (the plugin is opt-in)"
  fi
done
for s in dist/*.tar.gz; do
  tar tzf "$s" | grep '^[^/]*/LICENSE$' >/dev/null || fail "$s has no LICENSE"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The locked versions of everything but the workspace (torch above all), as constraints.
uv export --frozen --no-emit-workspace --no-hashes --all-groups -q -o "$tmp/constraints.txt"

refresh=()
for w in dist/*.whl; do
  name=$(basename "$w" | cut -d- -f1)
  refresh+=(--refresh-package "${name//_/-}")
done

# check PACKAGE README "EXPECTED MEGA PACKAGES (sorted, space-separated)"
check() {
  local pkg=$1 readme=$2 expected=$3
  local venv="$tmp/venv-$pkg" py
  uv venv -q --python .venv/bin/python "$venv"
  local t0=$SECONDS
  py="$venv/bin/python"
  # --refresh-package: uv's cache may hold an older build of the same name and version.
  uv pip install -q --python "$py" -c "$tmp/constraints.txt" --find-links dist "${refresh[@]}" "$pkg" \
    || fail "installing $pkg from dist failed"
  echo "CI wheels: $pkg installed in a fresh venv in $((SECONDS - t0)) s"

  local got
  got=$(uv pip list -q --python "$py" --format freeze | grep '^mega-' | cut -d= -f1 | sort | paste -sd' ')
  [ "$got" = "$expected" ] || fail "installing $pkg alone gave the mega packages [$got], expected [$expected]"

  # The README's example: the first python block after "## Example", launched as its first
  # line says (`# torchrun --nproc-per-node N file.py`).
  mkdir -p "$tmp/run-$pkg"
  awk '/^## Example/ {ex = 1} ex && /^```python/ {on = 1; next} on && /^```/ {exit} on {print}' \
    "$readme" >"$tmp/run-$pkg/example.py"
  local nproc
  nproc=$(sed -n '1s/^# torchrun --nproc-per-node \([0-9]*\) .*/\1/p' "$tmp/run-$pkg/example.py")
  [ -n "$nproc" ] || fail "$readme: no '## Example' python block starting '# torchrun --nproc-per-node N'"

  local out rc=0
  out=$(cd "$tmp/run-$pkg" && OMP_NUM_THREADS=1 "$venv/bin/torchrun" --standalone \
    --nproc-per-node "$nproc" example.py 2>&1) || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "$out" >&2
    fail "$readme example exited $rc in a venv with only $pkg installed"
  fi
  # Found in the venv, not in the source tree (find_spec does not import torch).
  (cd "$tmp" && "$py" -c "import importlib.util as u, sys; sys.exit(not u.find_spec('${pkg//-/_}').origin.startswith('$venv'))") \
    || fail "$pkg does not come from its fresh venv"
  echo "CI wheels: $pkg alone ($got) ran its README example on $nproc ranks (at $((SECONDS - start)) s)"
}

check mega-moe packages/moe/README.md "mega-moe mega-parallel-grid mega-tp-layers"
check mega-tp-layers packages/tp-layers/README.md "mega-parallel-grid mega-tp-layers"
echo "CI wheels: $(ls dist | wc -l) files in dist/, all checks passed in $((SECONDS - start)) s"
