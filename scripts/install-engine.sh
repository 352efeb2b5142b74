#!/usr/bin/env bash
# Installs one engine's pinned packages for the integration tests: every line of
# REQUIREMENTS with --no-deps (an engine's own pins, a CUDA torch among them, never
# replace the CPU torch), then fails loudly if MODULE does not import. Skips when
# .venv/.NAME-stamp matches the requirements file. Used by setup-vllm.sh and
# setup-sglang.sh; needs scripts/setup.sh first (.venv).
#   bash scripts/install-engine.sh NAME LABEL REQUIREMENTS MODULE
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1 label=$2 requirements=$3 module=$4

stamp=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ -f ".venv/.$name-stamp" ] && [ "$(cat ".venv/.$name-stamp")" = "$stamp" ]; then
    exit 0
fi
echo "setup: installing $label for the integration tests ($requirements, --no-deps; a minute or two the first time)"
started=$SECONDS
# a line every 20 s while pip is quiet; the sleep does not hold stdout, so a reader of
# this script's output is not kept waiting after it
(t0=$(date +%s); while sleep 20 >/dev/null 2>&1; do echo "setup:   ... still installing $label ($(( $(date +%s) - t0 )) s)"; done) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
set +e
.venv/bin/pip install --disable-pip-version-check --progress-bar off --no-deps \
    -r "$requirements" 2>&1 \
    | grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR|error)" \
    | sed -u "s/^/setup:   /"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    echo "setup: $label install failed (exit $status); rerun to see pip's output:" >&2
    echo "  .venv/bin/pip install --no-deps -r $requirements" >&2
    exit 1
fi
.venv/bin/python -c "import $module"  # the modules tierkv plugs into must import
kill $ticker 2>/dev/null || true
echo "setup: $label installed in $((SECONDS - started)) s"
echo "$stamp" > ".venv/.$name-stamp"
