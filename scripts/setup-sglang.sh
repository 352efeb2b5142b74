#!/usr/bin/env bash
# SGLang for the tierkv.integrations.sglang tests (scripts/test.sh runs this; nothing
# else in tierkv needs it). Every package is pinned in requirements-sglang.txt and
# installed with --no-deps into the same .venv as vLLM: nothing SGLang's HiCache
# storage modules import clashes with requirements-vllm.txt, and SGLang's own pins (a
# CUDA torch, transformers 5.19) are never installed. Idempotent; fast when nothing
# changed. Needs scripts/setup.sh first (.venv).
set -euo pipefail
exec bash "$(dirname "$0")/install-engine.sh" sglang SGLang requirements-sglang.txt \
    sglang.srt.mem_cache.storage.backend_factory
