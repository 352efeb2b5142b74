#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-servers.sh   # redis-server, Mooncake's libraries for the tier tests
bash scripts/setup.sh
bash scripts/setup-vllm.sh      # vLLM for tests/integrations (not needed by the demo)
bash scripts/setup-sglang.sh    # SGLang for tests/integrations/sglang (same .venv, --no-deps)
bash scripts/setup-lmcache.sh   # LMCache for tests/integrations/lmcache (same .venv, --no-deps)
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"; ruff check .
echo "== mypy"; mypy tierkv tiers/nvme/tierkv_nvme tiers/redis/tierkv_redis tiers/s3/tierkv_s3 \
    tiers/mooncake/tierkv_mooncake plugins/tierkv-sqlite/tierkv_sqlite
echo "== lint-imports"; lint-imports --no-cache --no-logo
echo "== docs"; docs_site=$(mktemp -d)   # the manual: offline, a broken link fails
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$docs_site"; rm -rf "$docs_site"
echo "== pytest"; pytest "$@"
