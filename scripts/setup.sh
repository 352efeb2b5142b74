#!/usr/bin/env bash
# Idempotent setup: a virtualenv in .venv and the dev requirements (reinstalled only
# when a requirements or pyproject file changed). Safe to rerun; fast when nothing
# changed. No system packages: the tests' servers come from scripts/setup-servers.sh.
# Every step prints a line, and pip prints one line per package, so a slow network
# shows as progress, not as a hang.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi

# the nvme tier's compiled core (setup.py, *.c) is built at install: a change to it reinstalls
stamp_inputs=$(cat requirements-dev.txt requirements-docs.txt $(git ls-files '*pyproject.toml' 2>/dev/null || ls pyproject.toml) tiers/nvme/setup.py tiers/nvme/tierkv_nvme/*.c | sha256sum | cut -d' ' -f1)
if [ ! -f .venv/.setup-stamp ] || [ "$(cat .venv/.setup-stamp)" != "$stamp_inputs" ]; then
    echo "setup: installing Python requirements into .venv (one line per package; ~2 min the first time)"
    started=$SECONDS
    # distributions renamed to tierkv-cache*: drop the old editable installs of this
    # checkout, or their entry points would claim every tier type twice
    for old in tierkv tierkv-nvme tierkv-redis tierkv-s3 tierkv-sqlite; do
        where=$(.venv/bin/pip show "$old" 2>/dev/null | sed -n 's/^Editable project location: //p' || true)
        if [ -n "$where" ] && [[ "$where" == "$PWD"* ]]; then
            echo "setup:   removing $old (renamed: now tierkv-cache${old#tierkv})"
            .venv/bin/pip uninstall -y -q "$old" >/dev/null
        fi
    done
    # pip's own lines (Collecting / Installing), without the bar that a log cannot show
    # a line every 20 s while pip is quiet (installing torch takes a while)
    (t0=$(date +%s); while sleep 20; do echo "setup:   ... still installing ($(( $(date +%s) - t0 )) s)"; done) &
    ticker=$!
    trap 'kill $ticker 2>/dev/null || true' EXIT
    set +e
    .venv/bin/pip install --disable-pip-version-check --progress-bar off -r requirements-dev.txt 2>&1 \
        | grep --line-buffered -E "^(Collecting|Obtaining|Building|Installing|Successfully|ERROR|error)" \
        | sed -u "s/^/setup:   /"
    status=${PIPESTATUS[0]}
    set -e
    kill $ticker 2>/dev/null || true
    if [ "$status" -ne 0 ] || ! .venv/bin/python -c "import tierkv" 2>/dev/null; then
        echo "setup: pip install failed (exit $status); its full output:" >&2
        echo "  .venv/bin/pip install -r requirements-dev.txt" >&2
        exit 1
    fi
    echo "setup: Python requirements installed in $((SECONDS - started)) s"
    echo "$stamp_inputs" > .venv/.setup-stamp
fi

