#!/usr/bin/env bash
# The Python package's suite: torch.distributed on the distcomm backend, DeepSpeed on it, the
# launchers, device staging. Creates (once) a venv with torch, DeepSpeed, maturin and pytest
# from PyPI, installs the package from source with pip (maturin builds it), and runs pytest.
#   scripts/python-tests.sh [PYTEST ARGS]      (venv: $DISTCOMM_VENV, default ~/.cache/distcomm-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DISTCOMM_VENV:-$HOME/.cache/distcomm-venv}"
PY="${PYTHON:-python3}"

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi
need_apt=()
"$PY" -c 'import ensurepip, venv' 2>/dev/null || need_apt+=(python3-venv)
# DeepSpeed's CPU accelerator JIT-builds its shared-memory kernel: it needs Python's headers.
"$PY" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}" g++
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch deepspeed maturin pytest ninja numpy
# The user's path: pip builds the package from source (maturin, a release build).
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps ./crates/distcomm-python
# The launcher test runs the distcomm command.
cargo build -q -p distcomm-cli
export PATH="$VENV/bin:$PATH"
cd crates/distcomm-python
exec "$VENV/bin/python" -m pytest -q "$@" tests
