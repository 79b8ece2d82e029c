#!/usr/bin/env bash
# Installs the real torch wheel and transformers from PyPI into a cached
# virtual environment outside the repository, for the tests against the real
# package (crates/torch/tests/real_torch.rs, python/tests_real/) and the
# real-model programs (benches/programs/: configurations built in code,
# nothing downloaded at run time).
#
#   scripts/torch-venv.sh          # install once; later runs reuse it
#
# The environment: $QUILT_TORCH_VENV, by default ~/.cache/quilt/torch-venv.
# The torch version: $QUILT_TORCH_VERSION, by default the pin below; the
# transformers version: $QUILT_TRANSFORMERS_VERSION, likewise.
#
# It never fails: where the install is impossible (no venv module, no
# network, no disk) it writes the reason to $QUILT_TORCH_VENV.status
# (beside the environment) and exits 0, and the tests that need torch
# report themselves skipped with that reason. Where it succeeds the status
# file says "ok torch <version>, transformers <version>" and the environment's
# python imports both. Where torch installs but transformers does not, torch
# is kept and the status says "ok torch <version>; transformers skipped: ...".
# Idempotent: a complete environment with the pinned versions is reused
# (seconds); one with the pinned torch but not the pinned transformers gets
# transformers installed beside it, torch (about 5 GB) untouched; a broken or
# partial one is removed and made again.
set -uo pipefail

VENV="${QUILT_TORCH_VENV:-$HOME/.cache/quilt/torch-venv}"
VERSION="${QUILT_TORCH_VERSION:-2.15.0}"
# The newest transformers release that runs with torch 2.15 when pinned.
TRANSFORMERS="${QUILT_TRANSFORMERS_VERSION:-5.23.0}"
STATUS="$VENV.status"
mkdir -p "$(dirname "$VENV")" || {
    echo "torch-venv: cannot create $(dirname "$VENV"); the real-torch tests will be skipped" >&2
    exit 0
}

note() {
    # The status file is what the tests read; the line is for the CI log.
    printf '%s\n' "$1" >"$STATUS.tmp" && mv "$STATUS.tmp" "$STATUS"
    echo "torch-venv: $1"
}

# One installer at a time (CI and a developer, or two worktrees).
exec 9>"$VENV.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi

have_torch() {
    [ -x "$VENV/bin/python" ] &&
        "$VENV/bin/python" - "$VERSION" <<'EOF' 2>/dev/null
import sys, torch
want = sys.argv[1]
sys.exit(0 if torch.__version__.split("+")[0] == want else 1)
EOF
}

have_transformers() {
    "$VENV/bin/python" - "$TRANSFORMERS" <<'EOF' 2>/dev/null
import sys, transformers
sys.exit(0 if transformers.__version__ == sys.argv[1] else 1)
EOF
}

have() {
    have_torch && have_transformers
}

# Installs the pinned transformers into an environment that has torch; on
# failure torch stays and the status says why transformers is missing.
add_transformers() {
    if ! "$VENV/bin/python" -m pip install --no-cache-dir --disable-pip-version-check \
        --progress-bar off "transformers==$TRANSFORMERS" >>"$VENV.log" 2>&1; then
        note "ok torch $VERSION; transformers skipped: pip install transformers==$TRANSFORMERS failed ($(tail -n 1 "$VENV.log"))"
        return 1
    fi
    if ! have_transformers; then
        note "ok torch $VERSION; transformers skipped: transformers==$TRANSFORMERS installed but does not import ($(tail -n 1 "$VENV.log"))"
        return 1
    fi
    return 0
}

if have; then
    note "ok torch $VERSION, transformers $TRANSFORMERS ($VENV, reused)"
    exit 0
fi

# torch is there: only transformers is added (or replaced by the pinned one).
if have_torch; then
    start=$(date +%s)
    : >"$VENV.log"
    if add_transformers; then
        secs=$(($(date +%s) - start))
        note "ok torch $VERSION, transformers $TRANSFORMERS ($VENV, torch reused, transformers installed in ${secs} s)"
    fi
    exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
if ! python3 -m venv "$VENV" >"$VENV.log" 2>&1; then
    # Debian's python3 needs python3-venv for ensurepip.
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && apt-get install -y -qq python3-venv; } >>"$VENV.log" 2>&1
        rm -rf "$VENV"
        python3 -m venv "$VENV" >>"$VENV.log" 2>&1
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    note "skipped: python3 -m venv failed ($(tail -n 1 "$VENV.log" 2>/dev/null))"
    rm -rf "$VENV"
    exit 0
fi
# The default index's torch is the CUDA build: its nvidia-* wheels make it
# about 5 GB installed. No pip cache: it would double the disk used.
if ! "$VENV/bin/python" -m pip install --no-cache-dir --disable-pip-version-check \
    --progress-bar off "torch==$VERSION" >>"$VENV.log" 2>&1; then
    note "skipped: pip install torch==$VERSION failed ($(tail -n 1 "$VENV.log"))"
    rm -rf "$VENV"
    exit 0
fi
if ! have_torch; then
    note "skipped: torch==$VERSION installed but does not import ($(tail -n 1 "$VENV.log"))"
    rm -rf "$VENV"
    exit 0
fi
add_transformers || exit 0
secs=$(($(date +%s) - start))
size=$(du -sh "$VENV" 2>/dev/null | cut -f1)
note "ok torch $VERSION, transformers $TRANSFORMERS ($VENV, installed in ${secs} s, ${size})"
