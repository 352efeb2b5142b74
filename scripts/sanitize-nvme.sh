#!/usr/bin/env bash
# The nvme tier's compiled core (_batchio.c, _blake3.c) under AddressSanitizer and
# UndefinedBehaviorSanitizer: builds a sanitized copy of the extension in a scratch
# worktree of HEAD and runs the tests that drive the core (the nvme tier's, and the
# LMCache and SGLang adapters' over it). Not part of the test command (a sanitizer's
# runtime depends on the kernel's address-space layout); run it after changing the C.
#   bash scripts/sanitize-nvme.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
scratch=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$scratch" >/dev/null 2>&1 || rm -rf "$scratch"' EXIT
git worktree add -f -q --detach "$scratch" HEAD
(cd "$scratch/tiers/nvme" &&
  CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -O1 -g" \
  LDFLAGS="-fsanitize=address,undefined" \
  "$root/.venv/bin/python" setup.py -q build_ext --inplace >/dev/null)
preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
cd "$scratch"
LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  PYTHONPATH="$scratch:$scratch/tiers/nvme" \
  "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider \
  tiers/nvme/tests tests/integrations/lmcache tests/integrations/sglang "$@"
