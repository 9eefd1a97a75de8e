#!/usr/bin/env bash
# One diagnostic device call (run through run_gpu_suite.sh exec): where the lone-op latency and
# the bf16 step tail go. Writes logs under $OUT; prints a short summary last.
set -u
cd "$(dirname "$0")/.."
PY=$(command -v python3)
MPI=(mpirun --allow-run-as-root --bind-to none -np 2 -x NCCL_NVLS_ENABLE
     -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONPATH -x PATH
     -x LD_LIBRARY_PATH)
SUM="$OUT/summary.txt"
: >"$SUM"
step() { echo "== $*" | tee -a "$OUT/diag.log"; timeout 150 "$@" 2>&1 | tee -a "$OUT/diag.log" \
         | grep -E "^(  |BIND|host cost|lone|lone_loop|RESULT|BREAKDOWN|PHASES|size|----|[0-9]+ [KMG]iB|allreduce float)" | tee -a "$SUM"; }
what="${1:-all}"
if [[ $what == all || $what == lat ]]; then
    step "${MPI[@]}" "$PY" -u benchmarks/latency_probe.py --device cuda --bytes 4096
    step "${MPI[@]}" "$PY" -u benchmarks/latency_probe.py --device cuda --bytes 4096 --sync-api
    step "${MPI[@]}" "$PY" -u benchmarks/latency_probe.py --device cuda --bytes 67108864 --iters 100
fi
if [[ $what == all || $what == sweep ]]; then
    step "${MPI[@]}" "$PY" -u benchmarks/gpu_allreduce.py --json "$OUT/allreduce.json" \
        --lone-sizes 4096 --max-bytes 268435456
fi
if [[ $what == all || $what == bf16 ]]; then
    for r in 1 2; do
        step "${MPI[@]}" "$PY" -u benchmarks/gpu_resnet.py --amp --iters 90 --warmup 15 \
            --repeats 3 --breakdown
        step "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            benchmarks/ddp_resnet.py --amp --iters 90 --warmup 15 --repeats 3 --phases
    done
fi
if [[ $what == all || $what == spy ]] && [[ -n "${PYSPY:-}" ]]; then
    step "${MPI[@]}" sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then exec '"$PYSPY"' record \
        --nonblocking --threads -r 400 -f raw -o '"$OUT"'/pyspy_bf16.txt -- '"$PY"' -u \
        benchmarks/gpu_resnet.py --amp --iters 60 --warmup 15 --repeats 3; else exec '"$PY"' -u \
        benchmarks/gpu_resnet.py --amp --iters 60 --warmup 15 --repeats 3; fi'
fi
if [[ $what == ab ]]; then  # enqueue costs; bf16 A/B of the control plane's waiting
    step "$PY" -u benchmarks/enqueue_micro.py
    R=(benchmarks/gpu_resnet.py --amp --iters 90 --warmup 15 --repeats 3 --breakdown)
    step "${MPI[@]}" "$PY" -u "${R[@]}"
    step "${MPI[@]}" -x OMPI_MCA_mpi_yield_when_idle=1 "$PY" -u "${R[@]}" --tag yield
    step "$PY" -m launcher -np 2 --tcp "$PY" -u "${R[@]}" --tag tcp
    step "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/ddp_resnet.py --amp --iters 90 --warmup 15 --repeats 3 --phases
    lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))" | tee -a "$SUM"
fi
if [[ $what == prof ]]; then  # py-spy of the lone synchronous op (needs PYSPY)
    step "$PY" -u benchmarks/lone_loop.py --device cuda --iters 5000
    step "${MPI[@]}" "$PY" -u benchmarks/lone_loop.py --device cuda --iters 5000
    if [[ -n "${PYSPY:-}" ]]; then
        # --nonblocking: a sampler that pauses one rank makes the other wait in the
        # negotiation round (call 1 of session 3: 1.4–1.7 ms per op instead of ~0.15 ms).
        step "$PYSPY" record --nonblocking -r 1000 -f raw -o "$OUT/spy_size1.txt" -- "$PY" -u \
            benchmarks/lone_loop.py --device cuda --iters 20000
        step "${MPI[@]}" sh -c 'exec '"$PYSPY"' record --nonblocking -r 1000 -f raw -o '"$OUT"'/spy_rank$OMPI_COMM_WORLD_RANK.txt -- '"$PY"' -u benchmarks/lone_loop.py --device cuda --iters 20000'
    fi
fi
if [[ $what == lone ]]; then  # lone-op latency: per-call costs, each impl alone, probe
    # OLD=dir: a copy of an older tree (its benchmarks/ and packages) for a same-call A/B.
    step "$PY" -u benchmarks/enqueue_micro.py
    for r in $(seq "${ROUNDS:-2}"); do
        step "${MPI[@]}" "$PY" -u benchmarks/lone_loop.py --device cuda --impl torch --iters 4000
        step "${MPI[@]}" "$PY" -u benchmarks/lone_loop.py --device cuda --iters 4000
        if [[ -n "${OLD:-}" ]]; then
            step "${MPI[@]}" "$PY" -u "$OLD/benchmarks/lone_loop.py" --device cuda --iters 4000 \
                --tag old
        fi
    done
    step "${MPI[@]}" "$PY" -u benchmarks/latency_probe.py --device cuda --sync-api --iters 1000
fi
if [[ $what == scal ]]; then  # bf16 1 -> 2 GPU scaling: phases at 1 GPU, then ROUNDS of
    # (2 GPUs with the step breakdown, 1 GPU again) so that machine drift shows; with PYSPY a
    # per-thread profile of rank 0 at 2 GPUs (training and coordinator threads).
    R=(benchmarks/gpu_resnet.py --amp --iters 60 --warmup 15 --repeats 3 --phases)
    step "$PY" -u "${R[@]}"
    for r in $(seq "${ROUNDS:-2}"); do
        step "${MPI[@]}" "$PY" -u "${R[@]}" --breakdown
        step "$PY" -u "${R[@]}"
    done
    if [[ -n "${PYSPY:-}" ]]; then
        step "${MPI[@]}" sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then exec '"$PYSPY"' record \
            --nonblocking --threads -r 400 -f raw -o '"$OUT"'/pyspy_scal.txt -- '"$PY"' -u \
            benchmarks/gpu_resnet.py --amp --iters 60 --warmup 15 --repeats 3; else exec \
            '"$PY"' -u benchmarks/gpu_resnet.py --amp --iters 60 --warmup 15 --repeats 3; fi'
    fi
fi
if [[ $what == conc ]]; then  # is bf16 scaling bounded by the machine? Per round and binding
    # (RINGVOD_BENCH_BIND, benchmarks/_affinity.py): GPU 0 alone, two independent 1-GPU runs at
    # once (GPUs 0 and 1, no communication), then the 2-GPU job. With PYSPY: rank 0 of the
    # 2-GPU job sampled only while a thread holds the GIL (who holds it, how often).
    lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node)" | tee -a "$SUM"
    nvidia-smi topo -m 2>/dev/null | tee -a "$SUM" | head -4
    R=(benchmarks/gpu_resnet.py --amp --iters 150 --warmup 30 --repeats 3)
    pair() {
        for g in 0 1; do
            CUDA_VISIBLE_DEVICES=$g RINGVOD_BENCH_GPU=$g timeout 150 "$PY" -u "${R[@]}" \
                --tag="-pair$g-$1" >"$OUT/pair$g.log" 2>&1 &
        done
        wait
        cat "$OUT"/pair[01].log >>"$OUT/diag.log"
        grep -hE "^(RESULT|BIND)" "$OUT"/pair[01].log | tee -a "$SUM"
    }
    for r in $(seq "${ROUNDS:-2}"); do
        for b in ${BINDS:-none split}; do
            export RINGVOD_BENCH_BIND=$b
            step env CUDA_VISIBLE_DEVICES=0 RINGVOD_BENCH_GPU=0 "$PY" -u "${R[@]}" \
                --tag="-solo-$b" --phases
            echo "== pair $b" | tee -a "$SUM"
            pair "$b"
            step "${MPI[@]}" -x RINGVOD_BENCH_BIND "$PY" -u "${R[@]}" --tag="-2gpu-$b" \
                --phases --breakdown
        done
    done
    if [[ -n "${PYSPY:-}" ]]; then
        export RINGVOD_BENCH_BIND=none
        step "${MPI[@]}" sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then exec '"$PYSPY"' record \
            --nonblocking --threads --gil -r 500 -f raw -o '"$OUT"'/pyspy_gil.txt -- '"$PY"' -u \
            benchmarks/gpu_resnet.py --amp --iters 150 --warmup 30 --repeats 3; else exec \
            '"$PY"' -u benchmarks/gpu_resnet.py --amp --iters 150 --warmup 30 --repeats 3; fi'
    fi
fi
if [[ $what == sched ]]; then  # bucket schedule on/off, bf16 autocast, ROUNDS alternating
    # rounds of: GPU 0 alone, the 2-GPU job with the schedule (default), the 2-GPU job with
    # HOROVOD_BUCKET_SCHEDULE=0 (every bucket negotiated), DDP on 2 GPUs. ARGS adds options
    # (e.g. "--compression bf16"; empty AMP drops --amp); NODDP=1 skips DDP.
    R=(benchmarks/gpu_resnet.py ${AMP---amp} --iters 150 --warmup 30 --repeats 3 ${ARGS:-})
    D=(benchmarks/ddp_resnet.py ${AMP---amp} --iters 150 --warmup 30 --repeats 3)
    for r in $(seq "${ROUNDS:-3}"); do
        step env CUDA_VISIBLE_DEVICES=0 "$PY" -u "${R[@]}" --tag="-solo"
        step "${MPI[@]}" "$PY" -u "${R[@]}" --tag="-sched" --breakdown
        step "${MPI[@]}" -x HOROVOD_BUCKET_SCHEDULE=0 "$PY" -u "${R[@]}" --tag="-nosched" \
            --breakdown
        [[ -n "${NODDP:-}" ]] || step "$PY" -m torch.distributed.run --standalone \
            --nproc-per-node 2 "${D[@]}"
    done
fi
if [[ $what == all || $what == tests ]]; then
    echo "== tests/gpu (mpi mode)" | tee -a "$SUM"
    RINGVOD_TEST_REQUIRE=gpu,mpi timeout 200 "$PY" -m pytest -q -p no:cacheprovider -rfEs \
        tests/gpu -k "spmd and mpi" 2>&1 | tee "$OUT/tests.log" | tail -3 | tee -a "$SUM"
fi
echo "==== summary"; cat "$SUM"
