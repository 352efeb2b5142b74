#!/usr/bin/env bash
# LMCache for the tierkv.integrations.lmcache tests (scripts/test.sh runs this; nothing
# else in tierkv needs it). Every package is pinned in requirements-lmcache.txt and
# installed with --no-deps into the same .venv as vLLM and SGLang: nothing LMCache's L2
# adapter modules import clashes with their pins, and LMCache's own (CUDA cupy and
# cuda-python, numpy<=2.2.6) are never installed. Idempotent; fast when nothing
# changed. Needs scripts/setup.sh first (.venv).
set -euo pipefail
exec bash "$(dirname "$0")/install-engine.sh" lmcache LMCache requirements-lmcache.txt \
    lmcache.v1.distributed.l2_adapters.plugin_l2_adapter
