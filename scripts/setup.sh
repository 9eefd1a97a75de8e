#!/usr/bin/env bash
# One-command set-up for a fresh machine: Python dependencies (CPU PyTorch first, so that the
# `torch` extra does not pull a multi-GB CUDA build), then ringvod in editable mode with its test,
# MPI and plotting extras; plus the OpenSSH server/client used by the multi-host launcher tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[mpi,torch,test,yaml,plot]"
$PY -m pip install -q "tensorflow-cpu>=2.16"  # the TensorFlow/Keras adapter's tests
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      openssh-server openssh-client >/dev/null) || echo "warning: could not install openssh"
  else
    echo "note: sshd not found; multi-host launcher tests will be skipped"
  fi
fi
echo "ringvod set-up done"
