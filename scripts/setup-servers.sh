#!/usr/bin/env bash
# System packages the tests need and nothing else does: the real servers the tier
# tests start (redis-server; openssl for its TLS certificates) and the libraries
# Mooncake Store's binding and mooncake_master link even over TCP (libibverbs1,
# librdmacm1, libnuma1; the binding itself is a pip wheel in requirements-dev.txt). The
# nvme tier's compiled core needs only the C compiler the image has. scripts/test.sh
# runs this; scripts/run.sh (the demo) does not need it. Idempotent; fast when installed.
set -euo pipefail

APT_PACKAGES=(redis-server openssl libibverbs1 librdmacm1 libnuma1)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing system packages for the tests: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "setup:   apt-get update"
    $SUDO apt-get update -qq
    echo "setup:   apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    echo "setup:   done"
fi
