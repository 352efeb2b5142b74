#!/usr/bin/env bash
# LMCache's own L2 adapter interface tests (tests/v1/distributed/test_mock_l2_adapter.py
# in its sdist) run on tierkv's adapter in place of their mock adapter, through the
# pytest plugin tests/integrations/lmcache/own_suite.py. Not part of scripts/test.sh:
# it needs LMCache's sdist, which the package index serves as lmcache-0.5.6.tar.gz.
#   bash scripts/lmcache-own-tests.sh /path/to/lmcache-0.5.6.tar.gz
# The test file and its conftest are copied out of the sdist (its top-level conftest
# imports LMCache's GPU engine); they run against the installed lmcache (setup-lmcache.sh).
# 43 of 44 pass (40 before the adapter declared its capacity: usage_fraction); the one
# left tests the mock's simulated slow bandwidth (a store taking over 0.1 s), which
# tierkv's adapter does not simulate.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sdist=${1:?usage: $0 lmcache-0.5.6.tar.gz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work"
src=$(echo "$work"/lmcache-*/tests/v1/distributed)
mkdir "$work/suite"
cp "$src/conftest.py" "$src/test_mock_l2_adapter.py" "$work/suite/"
cd "$work/suite"
PATH="${VIRTUAL_ENV:-$root/.venv}/bin:$PATH" \
PYTHONPATH="$root:$root/tiers/nvme:$root/tests/integrations/lmcache${PYTHONPATH:+:$PYTHONPATH}" \
    python -m pytest -p own_suite -c /dev/null --rootdir . -q -p no:cacheprovider \
    test_mock_l2_adapter.py "${@:2}"
