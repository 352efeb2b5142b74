#!/usr/bin/env bash
# SGLang for the tierkv.integrations.sglang tests (scripts/test.sh runs this; nothing
# else in tierkv needs it). Every package is pinned in requirements-sglang.txt and
# installed with --no-deps into the same .venv as vLLM: nothing SGLang's HiCache
# storage modules import clashes with requirements-vllm.txt, and SGLang's own pins (a
# CUDA torch, transformers 5.19) are never installed. Idempotent; fast when nothing
# changed. Needs scripts/setup.sh first (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."

sglang_stamp=$(sha256sum requirements-sglang.txt | cut -d' ' -f1)
if [ ! -f .venv/.sglang-stamp ] || [ "$(cat .venv/.sglang-stamp)" != "$sglang_stamp" ]; then
    echo "setup: installing SGLang for the integration tests (requirements-sglang.txt, --no-deps; ~1 min the first time)"
    started=$SECONDS
    set +e
    .venv/bin/pip install --disable-pip-version-check --progress-bar off --no-deps \
        -r requirements-sglang.txt 2>&1 \
        | grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR|error)" \
        | sed -u "s/^/setup:   /"
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" -ne 0 ]; then
        echo "setup: SGLang install failed (exit $status); rerun to see pip's output:" >&2
        echo "  .venv/bin/pip install --no-deps -r requirements-sglang.txt" >&2
        exit 1
    fi
    # fail here, loudly, if the modules tierkv plugs into do not import
    .venv/bin/python -c "import sglang.srt.mem_cache.storage.backend_factory"
    echo "setup: SGLang installed in $((SECONDS - started)) s"
    echo "$sglang_stamp" > .venv/.sglang-stamp
fi
