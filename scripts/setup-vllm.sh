#!/usr/bin/env bash
# vLLM for the tierkv.integrations.vllm tests (scripts/test.sh runs this; the demo and
# a server that does not use vLLM do not need it). Every package is pinned in
# requirements-vllm.txt and installed with --no-deps, so vLLM's CUDA torch pin never
# replaces the CPU torch. Idempotent; fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

vllm_stamp=$(sha256sum requirements-vllm.txt | cut -d' ' -f1)
if [ ! -f .venv/.vllm-stamp ] || [ "$(cat .venv/.vllm-stamp)" != "$vllm_stamp" ]; then
    echo "setup: installing vLLM for the integration tests (requirements-vllm.txt, --no-deps; ~2 min the first time)"
    started=$SECONDS
    # a line every 20 s while pip is quiet (vLLM takes a minute or more); the sleep does
    # not hold stdout, so a reader of this script's output is not kept waiting after it
    (t0=$(date +%s); while sleep 20 >/dev/null 2>&1; do echo "setup:   ... still installing vLLM ($(( $(date +%s) - t0 )) s)"; done) &
    ticker=$!
    trap 'kill $ticker 2>/dev/null || true' EXIT
    set +e
    .venv/bin/pip install --disable-pip-version-check --progress-bar off --no-deps \
        -r requirements-vllm.txt 2>&1 \
        | grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR|error)" \
        | sed -u "s/^/setup:   /"
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" -ne 0 ]; then
        echo "setup: vLLM install failed (exit $status); rerun to see pip's output:" >&2
        echo "  .venv/bin/pip install --no-deps -r requirements-vllm.txt" >&2
        exit 1
    fi
    # fail here, loudly, if the modules tierkv plugs into do not import
    .venv/bin/python -c "import vllm.v1.kv_offload.tiering.spec"
    kill $ticker 2>/dev/null || true
    echo "setup: vLLM installed in $((SECONDS - started)) s"
    echo "$vllm_stamp" > .venv/.vllm-stamp
fi
