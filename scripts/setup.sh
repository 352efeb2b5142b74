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

stamp_inputs=$(cat requirements-dev.txt $(git ls-files '*pyproject.toml' 2>/dev/null || ls pyproject.toml) | sha256sum | cut -d' ' -f1)
if [ ! -f .venv/.setup-stamp ] || [ "$(cat .venv/.setup-stamp)" != "$stamp_inputs" ]; then
    echo "setup: installing Python requirements into .venv (one line per package; ~2 min the first time)"
    started=$SECONDS
    # distributions renamed to tierkv-cache*: drop the old editable installs of this
    # checkout, or their entry points would claim every tier type twice
    for old in tierkv tierkv-nvme tierkv-redis tierkv-s3 tierkv-sqlite; do
        where=$(.venv/bin/pip show "$old" 2>/dev/null | sed -n 's/^Editable project location: //p')
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

# vLLM for the tierkv.integrations.vllm tests: every package pinned in its own file and
# installed with --no-deps, so vLLM's CUDA torch pin never replaces the CPU torch.
vllm_stamp=$(sha256sum requirements-vllm.txt | cut -d' ' -f1)
if [ ! -f .venv/.vllm-stamp ] || [ "$(cat .venv/.vllm-stamp)" != "$vllm_stamp" ]; then
    echo "setup: installing vLLM (requirements-vllm.txt, --no-deps) into .venv"
    log=$(mktemp)
    if ! .venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-vllm.txt >"$log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
        echo "setup: vLLM install failed (full log: $log)" >&2
        exit 1
    fi
    rm -f "$log"
    .venv/bin/python -c "import vllm.v1.kv_offload.tiering.spec" # fail here, loudly, if it did not work
    echo "$vllm_stamp" > .venv/.vllm-stamp
fi
