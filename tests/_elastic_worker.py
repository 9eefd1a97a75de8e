"""Worker of tests/integration/test_elastic.py, tests/gpu/test_elastic_gpu.py (and benchmarks/elastic_recovery.py).

A toy training loop under `hvd.elastic.run` whose result is exactly predictable: at step s every
rank r contributes `base(s) + r - (size-1)/2` and the average is `base(s)` at any size, in exact
floating point (small dyadic numbers). So the final weights are `-0.5 * sum(base(s))` over the
steps, each applied once, whatever resets happened; `log` lists the steps in the order they were
committed. Settings come from ET_* variables:

ET_OUT      directory for result.<rank>.json, progress and markers (required)
ET_STEPS    number of steps (default 30)
ET_COMMIT   commit every this many steps (default 3)
ET_SLEEP    seconds per step (default 0.05)
ET_KILL     "host:step[,host:step]": the worker on that host SIGKILLs itself once at that step
ET_KILL_AT_SIZE  "size:host,host": the workers on those hosts SIGKILL themselves at their first
            step at that world size (torch)
ET_FAIL     "host:step": the worker on that host exits 3 at that step (every time)
ET_KILL_ON_RESET  "size:host,host" (numpy): the workers on those hosts SIGKILL themselves once,
            1 s into the reset callbacks of their first reset to that world size, i.e. after
            the new world's init() and before the state sync (a new worker's first sync fails)
ET_KILL_IN_RENDEZVOUS  "size:host,host" (numpy): the workers on those hosts SIGKILL themselves
            once, when the driver has placed them in a world of that size, before they connect
            to it (the world fails to form: a new worker's first init() fails)
ET_SLOW_START  "worker:seconds": workers with an id >= worker sleep that long before `init()`
ET_FAIL_START  a host: its workers exit 3 before `init()` (a broken host)
ET_UPDATE_FAILS  a rank: the first HostsUpdatedInterrupt of `check_host_updates()` becomes a
            HorovodInternalError on that rank only, as when a peer dies during its broadcast
ET_TORCH    1: torch instead (TorchState: model, optimizer, ElasticSampler; see main_torch)
ET_DATASET, ET_BATCH  torch: dataset size (60) and batch size per rank (2)
ET_BPPS     torch: backward_passes_per_step (default 1); the averaged gradient is then
            ET_BPPS * base(step) (passes add up, as in Horovod)
ET_CHECK    torch: 1 calls `state.check_host_updates()` after every step that does not commit
ET_CUDA     1: torch on CUDA (NCCL), the worker of host "localhost" on GPU 0, others on GPU 1
ET_KERAS    1: Keras `fit` instead (KerasState and the elastic callbacks; see main_keras), with
            ET_BATCHES batches per epoch (default 4) and ET_STEPS // ET_BATCHES epochs
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

OUT = os.environ["ET_OUT"]
STEPS = int(os.environ.get("ET_STEPS", "30"))
COMMIT = int(os.environ.get("ET_COMMIT", "3"))
SLEEP = float(os.environ.get("ET_SLEEP", "0.05"))
HOST = os.environ.get("HOROVOD_HOSTNAME", "")
WID = os.environ.get("HOROVOD_ELASTIC_WORKER_ID", "?")
TORCH = os.environ.get("ET_TORCH") == "1"
KERAS = os.environ.get("ET_KERAS") == "1"

with open(os.path.join(OUT, f"pid.{WID}"), "w") as _f:
    _f.write(str(os.getpid()))
if HOST and HOST == os.environ.get("ET_FAIL_START"):
    sys.exit(3)
if os.environ.get("ET_SLOW_START"):  # a new worker that is slow to start (imports, CUDA, data)
    _first, _secs = os.environ["ET_SLOW_START"].split(":")
    if WID.isdigit() and int(WID) >= int(_first):
        time.sleep(float(_secs))


def base(s: int) -> float:
    return float(s % 7 - 3)


def _triggers(var: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for item in filter(None, os.environ.get(var, "").split(",")):
        h, s = item.rsplit(":", 1)
        out.setdefault(h, []).append(int(s))
    return out


KILL, FAIL = _triggers("ET_KILL"), _triggers("ET_FAIL")
KILL_AT_SIZE = (lambda v: (v[0], v[1].split(",")) if len(v) == 2 else None)(
    os.environ.get("ET_KILL_AT_SIZE", "").split(":", 1))
KILL_ON_RESET = (lambda v: (v[0], v[1].split(",")) if len(v) == 2 else None)(
    os.environ.get("ET_KILL_ON_RESET", "").split(":", 1))
KILL_IN_RENDEZVOUS = (lambda v: (v[0], v[1].split(",")) if len(v) == 2 else None)(
    os.environ.get("ET_KILL_IN_RENDEZVOUS", "").split(":", 1))


def _kill_in_rendezvous() -> None:
    """ET_KILL_IN_RENDEZVOUS: wraps the rendezvous with the driver (init() looks it up at
    every call)."""
    from collective import elastic

    placed = elastic.rendezvous

    def rendezvous(config):
        config, scope = placed(config)
        if config.size == int(KILL_IN_RENDEZVOUS[0]) and HOST in KILL_IN_RENDEZVOUS[1]:
            marker = os.path.join(OUT, f"killed_in_rendezvous.{HOST}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return config, scope

    elastic.rendezvous = rendezvous


def maybe_die(step: int) -> None:
    if step in KILL.get(HOST, []):
        marker = os.path.join(OUT, f"killed.{HOST}.{step}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            with open(os.path.join(OUT, "kill_times"), "a") as f:
                f.write(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
    if step in FAIL.get(HOST, []):
        sys.exit(3)


def progress(hvd, step: int) -> None:
    with open(os.path.join(OUT, f"progress.{WID}"), "a") as f:
        f.write(f"{time.time()} {hvd.rank()} {hvd.size()} {step}\n")


def main_numpy() -> None:
    import collective as hvd
    from collective import elastic

    if KILL_IN_RENDEZVOUS:
        _kill_in_rendezvous()
    hvd.init(process_sets=os.environ.get("ET_PROCESS_SETS") or None)  # "dynamic"
    state = elastic.ObjectState(step=0, w=np.zeros(4), log=[], sizes=[])
    if os.environ.get("ET_UPDATE_FAILS") == str(hvd.rank()):
        _fail_first_update(state)
    resets = []

    def on_reset() -> None:
        resets.append((hvd.size(), dict(elastic.last_reset_timings)))
        if KILL_ON_RESET and hvd.size() == int(KILL_ON_RESET[0]) and HOST in KILL_ON_RESET[1]:
            marker = os.path.join(OUT, f"killed_on_reset.{HOST}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(1.0)  # every rank's init() is done: the sync is what fails
                os.kill(os.getpid(), signal.SIGKILL)

    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state):
        first = True
        while state.step < STEPS:
            s = state.step
            maybe_die(s)
            g = np.full(4, base(s) + hvd.rank() - (hvd.size() - 1) / 2)
            avg = hvd.allreduce(g, name="grad")
            state.w = state.w - 0.5 * avg
            state.log.append(s)
            state.sizes.append(hvd.size())
            state.step += 1
            progress(hvd, state.step)
            if first and elastic.last_reset_timings:  # the first step after a reset
                with open(os.path.join(OUT, f"timings.{WID}"), "a") as f:
                    f.write(json.dumps(dict(elastic.last_reset_timings, step=time.time(),
                                            rank=hvd.rank(), size=hvd.size())) + "\n")
            first = False
            if state.step % COMMIT == 0:
                state.commit()
            time.sleep(SLEEP)
        state.commit()

    train(state)
    write(hvd, state.w, state, resets)


def _fail_first_update(state) -> None:
    from collective.errors import HorovodInternalError, HostsUpdatedInterrupt

    check = state.check_host_updates

    def check_host_updates() -> None:
        try:
            check()
        except HostsUpdatedInterrupt:
            if state.check_host_updates is check:
                raise
            state.check_host_updates = check  # once
            raise HorovodInternalError("test: the update's broadcast failed on this rank")

    state.check_host_updates = check_host_updates


def main_torch() -> None:
    """One epoch over ET_DATASET samples in batches of ET_BATCH per rank (ElasticSampler),
    SGD with momentum on a 4-weight linear model whose averaged gradient is base(step)."""
    import torch

    import horovod.torch as hvd
    from collective import elastic

    device = torch.device("cpu")
    if os.environ.get("ET_CUDA") == "1":  # one GPU per "host": localhost 0, any other 1
        device = torch.device("cuda", (0 if HOST == "localhost" else 1)
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
    hvd.init()
    model = torch.nn.Linear(4, 1, bias=False).to(device)
    with torch.no_grad():
        model.weight.zero_()
    passes = int(os.environ.get("ET_BPPS", "1"))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes)
    dataset = list(range(int(os.environ.get("ET_DATASET", "60"))))
    batch = int(os.environ.get("ET_BATCH", "2"))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, step=0, log=[], sizes=[],
                                   seen=[])
    resets = []
    state.register_reset_callbacks(
        [lambda: resets.append((hvd.size(), dict(elastic.last_reset_timings)))])

    @hvd.elastic.run
    def train(state):
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=state.sampler)
        for idx in loader:
            s = state.step
            maybe_die(s)
            if KILL_AT_SIZE and hvd.size() == int(KILL_AT_SIZE[0]) and HOST in KILL_AT_SIZE[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            scale = base(s) + hvd.rank() - (hvd.size() - 1) / 2
            for _ in range(passes):  # accumulated locally, one allreduce per step
                (model(torch.ones(1, 4, device=device)).sum() * scale).backward()
            opt.step()
            gathered = hvd.allgather_object([int(i) for i in idx])
            state.seen = state.seen + [i for part in gathered for i in part]
            state.sampler.record_batch(0, batch)
            state.log = state.log + [s]
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            progress(hvd, state.step)
            if state.step % COMMIT == 0:
                state.commit()
            elif os.environ.get("ET_CHECK") == "1":
                state.check_host_updates()
            time.sleep(SLEEP)
        state.commit()

    train(state)
    write(hvd, model.weight.detach().cpu().numpy().reshape(-1), state, resets)


def main_keras() -> None:
    """Keras `fit` of a 4-weight linear model (zeros, no bias) with SGD(0.5), one sample per
    batch: the loss `y_pred * y_true` makes the averaged gradient of batch b (of every epoch)
    exactly b + 1 at any size, so each epoch changes every weight by -0.5 * sum(b + 1). One
    `fit(epochs=1)` per epoch; after a reset mid-epoch the epoch resumes at `state.batch`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import horovod.tensorflow.keras as hvd
    from collective import elastic

    hvd.init()
    batches = int(os.environ.get("ET_BATCHES", "4"))
    epochs = STEPS // batches
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5)),
                  loss=lambda y_true, y_pred: y_pred * y_true)
    state = hvd.elastic.KerasState(model, epoch=0, batch=0, step=0, log=[], sizes=[])
    resets = []
    state.register_reset_callbacks(
        [lambda: resets.append((hvd.size(), dict(elastic.last_reset_timings)))])

    class Steps(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            maybe_die(state.step)

        def on_train_batch_end(self, batch, logs=None):
            state.log = state.log + [state.step]
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            progress(hvd, state.step)
            time.sleep(SLEEP)

    callbacks = [Steps(), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT)]

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            offset = hvd.rank() - (hvd.size() - 1) / 2
            todo = range(state.batch, batches)
            x = np.ones((len(todo), 4), np.float32)
            y = np.array([[b + 1 + offset] for b in todo], np.float32)
            model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)

    train(state)
    write(hvd, model.get_weights()[0].reshape(-1), state, resets)


def write(hvd, w, state, resets) -> None:
    from collective import _current
    res = {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "w": [float(x) for x in w],
           "log": list(state.log), "sizes": list(state.sizes), "resets": resets,
           "seen": list(getattr(state, "seen", [])), "host": HOST, "worker": WID,
           "dynamic_sets": _current.current().dynamic_process_sets}
    tmp = os.path.join(OUT, f".result.{hvd.rank()}.tmp")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, os.path.join(OUT, f"result.{hvd.rank()}.json"))


if __name__ == "__main__":
    main_torch() if TORCH else main_keras() if KERAS else main_numpy()
