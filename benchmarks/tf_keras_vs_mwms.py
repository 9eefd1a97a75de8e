"""ringvod vs TensorFlow's MultiWorkerMirroredStrategy: a small Keras CNN on synthetic images,
same model, batch, threads and machine, same run. Also the host-side cost of one allreduce from
TensorFlow against the same op from torch and from NumPy.

    python benchmarks/tf_keras_vs_mwms.py --np 2 --rounds 3
    python benchmarks/tf_keras_vs_mwms.py --host-cost

Training, on the same CNN (conv 32 - conv 64 - pool - dense 128 - dense 10, 32x32x3 images,
SGD) with the same per-rank batch, three sides:

* `ringvod-fit`: `model.fit` with `hvd.DistributedOptimizer` and
  `BroadcastGlobalVariablesCallback`, ranks under `mpirun` (`--mode tcp`: `hvdrun --gloo`);
* `ringvod-loop`: a `tf.function` step with `hvd.DistributedGradientTape`;
* `mwms-loop`: the same step under `MultiWorkerMirroredStrategy` (`strategy.run`, the Keras
  optimizer sums gradients across workers, loss scaled by the global batch), ranks given a
  `TF_CONFIG` cluster on localhost; global batch = per-rank batch x ranks, split by the
  strategy. (`model.fit` under MWMS fails in Keras 3.15 while building the model from a
  distributed batch, so TensorFlow's own baseline is its custom-loop pattern.)
 Each rank uses `--threads`
TensorFlow threads per pool. Rounds alternate the sides (and who goes first) so that load from
other processes hits them alike; reported: img/s over the timed steps (median and best round)
and the ratios of the medians to MWMS's.

Host cost (`--host-cost`, one process, world size 1, where an allreduce moves no data between
ranks): the time of one synchronous allreduce of a float32 tensor from each framework, and each
adapter's own conversions alone (input to the engine's NumPy view; engine output to a framework
tensor), with a copying conversion (`tf.constant`) for comparison. Medians of interleaved
blocks of calls.

Both modes print `LIBRARY <folder>` above their results: ringvod comes from a copy named on
`PYTHONPATH`, else this checkout (`_library.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

SIDES = ["ringvod-fit", "ringvod-loop", "mwms-loop"]


# -- worker side ----------------------------------------------------------------------------------
def _model(tf: Any, num_classes: int, image: int) -> Any:
    return tf.keras.Sequential([
        tf.keras.Input((image, image, 3)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(num_classes),
    ])


def _dataset(tf: Any, batch: int, image: int, num_classes: int) -> Any:
    import numpy as np
    g = np.random.default_rng(0)
    x = g.random((batch, image, image, 3), dtype=np.float32)
    y = g.integers(0, num_classes, batch)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


class _Timer:
    """A Keras callback timing the steps after the warm-up ones."""

    def __init__(self, keras: Any, warmup: int) -> None:
        outer = self

        class Cb(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                if batch == warmup:
                    outer.t0 = time.perf_counter()

            def on_train_end(self, logs: Any = None) -> None:
                outer.t1 = time.perf_counter()
        self.cb = Cb()
        self.t0 = self.t1 = 0.0


def worker(a: argparse.Namespace) -> None:
    import tensorflow as tf
    import keras
    steps = a.warmup + a.steps
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum_over_batch_size")
    if a.worker.startswith("ringvod"):
        import horovod.tensorflow as hvd
        hvd.init()
        n, rank = hvd.size(), hvd.rank()
        model = _model(tf, a.num_classes, a.image_size)
        data = _dataset(tf, a.batch_size, a.image_size, a.num_classes)
        if a.worker == "ringvod-fit":
            timer = _Timer(keras, a.warmup)
            model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                          loss=loss_fn)
            model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0,
                      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer.cb])
            elapsed = timer.t1 - timer.t0
        else:
            opt = tf.keras.optimizers.SGD(0.01)

            @tf.function
            def step(x: Any, y: Any) -> Any:
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                tape = hvd.DistributedGradientTape(tape)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            it = iter(data)
            for i in range(steps):
                if i == a.warmup:
                    t0 = time.perf_counter()
                loss = step(*next(it))
                if i == 0:
                    hvd.broadcast_variables(model.variables + opt.variables, 0)
            float(loss)
            elapsed = time.perf_counter() - t0
    else:  # TensorFlow's MultiWorkerMirroredStrategy, custom loop (see the module docstring)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        n = strategy.num_replicas_in_sync
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        with strategy.scope():
            model = _model(tf, a.num_classes, a.image_size)
            opt = tf.keras.optimizers.SGD(0.01)
        data = _dataset(tf, a.batch_size * n, a.image_size, a.num_classes)
        opts = tf.data.Options()
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        dist = strategy.experimental_distribute_dataset(data.with_options(opts))
        per_example = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                    reduction="none")

        def replica_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(per_example(y, model(x, training=True)),
                                                  global_batch_size=a.batch_size * n)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))  # sums across workers
            return loss

        @tf.function
        def step(batch: Any) -> Any:
            return strategy.run(replica_step, args=batch)
        it = iter(dist)
        for i in range(steps):
            if i == a.warmup:
                t0 = time.perf_counter()
            loss = step(next(it))
        float(strategy.reduce("SUM", loss, axis=None))
        elapsed = time.perf_counter() - t0
    if rank == 0:
        rate = a.batch_size * n * a.steps / elapsed
        print(json.dumps({"side": a.worker, "img_per_s": rate}), flush=True)


# -- driver side ----------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS=str(a.threads),
               TF_NUM_INTEROP_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    env["PYTHONPATH"] = _library.pythonpath()
    return env


def _worker_args(a: argparse.Namespace, side: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", side, "--batch-size",
            str(a.batch_size), "--image-size", str(a.image_size), "--num-classes",
            str(a.num_classes), "--warmup", str(a.warmup), "--steps", str(a.steps)]


def _result(out: str, side: str) -> float:
    for line in out.splitlines():  # under hvdrun (--mode tcp): "[0]<stdout>:{...}"
        i = line.find("{")
        if i >= 0 and f'"side": "{side}"' in line:
            return float(json.loads(line[i:])["img_per_s"])
    raise RuntimeError(f"{side} printed no result:\n{out[-3000:]}")


def run_ringvod(a: argparse.Namespace, side: str) -> float:
    if a.mode == "tcp":
        cmd = [sys.executable, "-m", "launcher", "--gloo", "-np", str(a.np)]
    else:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(a.np),
               "-x", "PYTHONPATH", "-x", "TF_NUM_INTRAOP_THREADS", "-x",
               "TF_NUM_INTEROP_THREADS", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "OMP_NUM_THREADS"]
    p = subprocess.run(cmd + _worker_args(a, side), env=_env(a), cwd=_library.NO_LIBRARY,
                       capture_output=True, text=True, timeout=a.timeout)
    return _result(p.stdout + p.stderr, side)


def run_mwms(a: argparse.Namespace, side: str = "mwms-loop") -> float:
    ports = _free_ports(a.np)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for i in range(a.np):
        env = _env(a)
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        procs.append(subprocess.Popen(_worker_args(a, side), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=a.timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return _result(outs[0], side)


def host_cost(a: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf
    import torch

    import collective
    import horovod.tensorflow as hvd_tf
    import horovod.torch as hvd_torch
    from frameworks.tensorflow import _buffers as tf_buffers
    from frameworks.torch import _buffers as torch_buffers
    collective.init()
    print(f"LIBRARY {_library.where()}")

    def per_call_us(fn: Any, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    for elems in (1024, 1 << 20):
        n = 1000 if elems <= 1024 else 20
        t_tf, t_torch = tf.ones([elems]), torch.ones(elems)
        arr = np.ones(elems, np.float32)
        out = tf_buffers.aligned_empty((elems,), arr)
        cases = {
            "tf_allreduce": lambda: hvd_tf.allreduce(t_tf, op=hvd_tf.Sum),
            "torch_allreduce": lambda: hvd_torch.allreduce(t_torch, op=hvd_torch.Sum),
            "numpy_allreduce": lambda: collective.allreduce(arr, op=collective.Sum),
            "tf_in (NumPy view)": lambda: tf_buffers.host_view(t_tf),
            "tf_out (DLPack wrap)": lambda: tf_buffers.to_tf(out, tf.float32),
            "tf_out by copy (tf.constant)": lambda: tf.constant(out),
            "torch_in (to_collective)": lambda: torch_buffers.to_collective(t_torch),
            "torch_out (from_collective)": lambda: torch_buffers.from_collective(out, t_torch),
        }
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for fn in cases.values():
            fn()
        for _ in range(a.rounds * 3):  # interleaved blocks: load hits every case alike
            for k, fn in cases.items():
                samples[k].append(per_call_us(fn, n))
        print(json.dumps({"elements": elems, "float32_bytes": elems * 4, "median_us": {
            k: round(statistics.median(v), 2) for k, v in samples.items()}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", choices=["mpi", "tcp"], default="mpi")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="TF threads per pool, per rank")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--host-cost", action="store_true")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.host_cost:
        return host_cost(a)
    res: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(a.rounds):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        for side in order:
            rate = run_mwms(a, side) if side.startswith("mwms") else run_ringvod(a, side)
            res[side].append(rate)
            print(f"round {r + 1}/{a.rounds} {side}: {rate:.1f} img/s", flush=True)
    med = {s: statistics.median(v) for s, v in res.items()}
    summary = {"np": a.np, "mode": a.mode, "batch_per_rank": a.batch_size,
               "image": a.image_size, "steps": a.steps, "threads": a.threads,
               "rounds": {s: [round(x, 1) for x in v] for s, v in res.items()},
               "median": {s: round(v, 1) for s, v in med.items()},
               "best": {s: round(max(v), 1) for s, v in res.items()},
               "ratio_ringvod_loop_over_mwms": round(med["ringvod-loop"] / med["mwms-loop"], 3),
               "ratio_ringvod_fit_over_mwms": round(med["ringvod-fit"] / med["mwms-loop"], 3)}
    print(f"LIBRARY {_library.where()}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
