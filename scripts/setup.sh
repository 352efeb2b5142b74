#!/usr/bin/env bash
# Idempotent setup: Debian packages the tests need, a virtualenv in .venv, and the
# dev requirements (reinstalled only when a requirements or pyproject file changed).
# Safe to rerun; fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(redis-server openssl)   # real servers the tier tests start

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi

stamp_inputs=$(cat requirements-dev.txt $(git ls-files '*pyproject.toml' 2>/dev/null || ls pyproject.toml) | sha256sum | cut -d' ' -f1)
if [ ! -f .venv/.setup-stamp ] || [ "$(cat .venv/.setup-stamp)" != "$stamp_inputs" ]; then
    echo "setup: installing Python requirements into .venv"
    log=$(mktemp)
    if ! .venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt >"$log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
        echo "setup: pip install failed (full log: $log)" >&2
        exit 1
    fi
    rm -f "$log"
    .venv/bin/python -c "import tierkv" # fail here, loudly, if the install did not work
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
