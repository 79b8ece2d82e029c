#!/usr/bin/env bash
# Installs the real torch wheel from PyPI into a cached virtual environment
# outside the repository, for the tests against the real package
# (crates/torch/tests/real_torch.rs, python/tests_real/).
#
#   scripts/torch-venv.sh          # install once; later runs reuse it
#
# The environment: $QUILT_TORCH_VENV, by default ~/.cache/quilt/torch-venv.
# The torch version: $QUILT_TORCH_VERSION, by default the pin below.
#
# It never fails: where the install is impossible (no venv module, no
# network, no disk) it writes the reason to $QUILT_TORCH_VENV.status
# (beside the environment) and exits 0, and the tests that need torch
# report themselves skipped with that reason. Where it succeeds the status
# file says "ok torch <version>" and the environment's python imports torch.
# Idempotent: a complete environment with the pinned version is reused
# (seconds); a broken or partial one is removed and made again.
set -uo pipefail

VENV="${QUILT_TORCH_VENV:-$HOME/.cache/quilt/torch-venv}"
VERSION="${QUILT_TORCH_VERSION:-2.15.0}"
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

have() {
    [ -x "$VENV/bin/python" ] &&
        "$VENV/bin/python" - "$VERSION" <<'EOF' 2>/dev/null
import sys, torch
want = sys.argv[1]
sys.exit(0 if torch.__version__.split("+")[0] == want else 1)
EOF
}

if have; then
    note "ok torch $VERSION ($VENV, reused)"
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
if ! have; then
    note "skipped: torch==$VERSION installed but does not import ($(tail -n 1 "$VENV.log"))"
    rm -rf "$VENV"
    exit 0
fi
secs=$(($(date +%s) - start))
size=$(du -sh "$VENV" 2>/dev/null | cut -f1)
note "ok torch $VERSION ($VENV, installed in ${secs} s, ${size})"
