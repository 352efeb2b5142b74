#!/usr/bin/env bash
# vLLM for the tierkv.integrations.vllm tests (scripts/test.sh runs this; the demo and
# a server that does not use vLLM do not need it). Every package is pinned in
# requirements-vllm.txt and installed with --no-deps, so vLLM's CUDA torch pin never
# replaces the CPU torch. Idempotent; fast when nothing changed.
set -euo pipefail
exec bash "$(dirname "$0")/install-engine.sh" vllm vLLM requirements-vllm.txt \
    vllm.v1.kv_offload.tiering.spec
