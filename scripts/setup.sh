#!/usr/bin/env bash
# Developer set-up on a fresh machine (users: see README.md, "Install"). It installs, saying so:
#   1. PyTorch's CPU build from download.pytorch.org, unless torch is already importable (PyPI's
#      default torch on Linux is the multi-GB CUDA build; TORCH_INDEX_URL picks another index);
#   2. ringvod in editable mode with its mpi (mpi4py + Open MPI wheel), torch, test, yaml,
#      plot, ray (ray[train]), tensorflow (tensorflow-cpu) and jax (jax CPU build, optax) extras;
#   3. as root with apt-get, when sshd is missing: openssh-server and openssh-client, which the
#      multi-host launcher tests use (they start their own sshd on 127.0.0.2). SKIP_SSH=1 skips
#      this step; without ssh those tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*"; }
$PY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if $PY -c "import torch" >/dev/null 2>&1; then
  say "PyTorch already installed ($($PY -c 'import torch; print(torch.__version__)'))"
else
  url=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
  say "installing PyTorch 2.13.0 from $url"
  $PY -m pip install -q "torch==2.13.0" --index-url "$url"
fi
say "installing ringvod (editable) with extras mpi, torch, test, yaml, plot, ray (ray[train]),"
say "tensorflow (tensorflow-cpu) and jax (jax, optax), for the Ray integration's and the"
say "TensorFlow and JAX adapters' tests"
$PY -m pip install -q -e ".[mpi,torch,test,yaml,plot,ray,tensorflow,jax]"
if [ "${SKIP_SSH:-0}" = 1 ]; then
  say "SKIP_SSH=1: not installing OpenSSH; the multi-host launcher tests will be skipped"
elif command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; then
  say "OpenSSH server found (used by the multi-host launcher tests)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing openssh-server and openssh-client with apt-get, for the multi-host launcher"
  say "tests (they start their own sshd on 127.0.0.2; SKIP_SSH=1 skips this)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    openssh-server openssh-client >/dev/null) || say "warning: could not install OpenSSH"
else
  say "note: sshd not found and not root with apt-get; multi-host launcher tests will be skipped"
fi
say "done"
