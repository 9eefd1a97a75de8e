"""`horovod.tensorflow.elastic` / `horovod.tensorflow.keras.elastic` in one process (size 1):
what `commit()`, `restore()` and `sync()` do to a Keras model, its optimizer and plain values,
when the Keras callbacks commit and what they record, and the retry loop restoring the last
commit after a failed collective. (The multi-process run with a killed worker is
tests/integration/test_elastic.py::test_tensorflow_keras_state_sigkill.)"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests._spmd import skip_or_fail

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="module")
def hvd():
    try:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    except ImportError as exc:
        skip_or_fail(f"tensorflow/keras not installed ({exc})", "tensorflow")
    import horovod.tensorflow.keras as hvd
    hvd.init()
    yield hvd
    hvd.shutdown()


def _model(hvd, momentum: float = 0.5):
    import keras
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(2, kernel_initializer="ones")])
    opt = keras.optimizers.SGD(0.1, momentum=momentum)
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss="mse")
    return model


def _values(variables) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _fit(model, batches: int, epochs: int = 1, callbacks=()):
    x = np.arange(batches * 2 * 4, dtype=np.float32).reshape(batches * 2, 4) / 10
    y = np.ones((batches * 2, 2), np.float32)
    model.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def test_keras_state_commit_restore_sync(hvd) -> None:
    model = _model(hvd)
    state = hvd.elastic.KerasState(model, epoch=0, names=["a"])
    assert state.optimizer is model.optimizer
    opt_vars = list(model.optimizer.variables)
    assert len(opt_vars) > 2, "the optimizer is built (momentum slots) at construction"
    start = _values(model.variables) + _values(opt_vars)

    _fit(model, 3)
    state.epoch, state.names = 1, state.names + ["b"]
    state.commit()
    committed = _values(model.variables) + _values(opt_vars)
    assert not all(np.array_equal(a, b) for a, b in zip(start, committed))

    _fit(model, 2)
    state.epoch = 5
    state.names.append("c")
    assert int(model.optimizer.iterations.numpy()) == 5
    state.restore()
    assert state.epoch == 1 and state.names == ["a", "b"]
    for a, b in zip(committed, _values(model.variables) + _values(opt_vars)):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations.numpy()) == 3

    state.sync()  # size 1: rank 0's values stay, and become the commit
    _fit(model, 1)
    state.restore()
    for a, b in zip(committed, _values(model.variables) + _values(opt_vars)):
        np.testing.assert_array_equal(a, b)


def test_tensorflow_state_variables(hvd) -> None:
    import tensorflow as tf

    import horovod.tensorflow as hvd_tf
    assert hvd_tf.elastic.TensorFlowKerasState is hvd.elastic.TensorFlowKerasState
    w, b = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
    state = hvd_tf.elastic.TensorFlowState([w, b], step=0)
    w.assign([5.0, 6.0])
    state.step = 2
    state.commit()
    w.assign_add([1.0, 1.0])
    b.assign(0.0)
    state.step = 9
    state.restore()
    assert w.numpy().tolist() == [5.0, 6.0] and float(b.numpy()) == 3.0 and state.step == 2
    with pytest.raises(ValueError, match="session= is for TF1"):
        hvd_tf.elastic.TensorFlowState([w], session=object())


def test_callbacks_commit_every_n_batches_and_at_epoch_end(hvd) -> None:
    e = hvd.elastic
    model = _model(hvd)
    state = e.KerasState(model, epoch=0, batch=0)
    commits: list[tuple[int, int, int]] = []
    save = state.save

    def recording_save() -> None:
        commits.append((state.epoch, state.batch, int(model.optimizer.iterations.numpy())))
        save()
    state.save = recording_save

    callbacks = [e.UpdateBatchStateCallback(state), e.UpdateEpochStateCallback(state),
                 e.CommitStateCallback(state, batches_per_commit=3)]
    _fit(model, 4, epochs=2, callbacks=callbacks)
    # Every 3 batches (counting restarts at each epoch's end) and at each epoch's end.
    assert commits == [(0, 3, 3), (1, 0, 4), (1, 3, 7), (2, 0, 8)]
    assert state.epoch == 2 and state.batch == 0
    # A later fit continues the epoch count (fit(epochs=epochs - state.epoch)).
    _fit(model, 1, epochs=1, callbacks=callbacks)
    assert state.epoch == 3 and commits[-1] == (3, 0, 9)
    with pytest.raises(ValueError, match="batches_per_commit must be >= 1"):
        e.CommitStateCallback(state, batches_per_commit=0)


def test_batch_counter_counts_from_a_resumed_batch(hvd) -> None:
    """After a reset mid-epoch the training function resumes at `state.batch` with a shorter
    `fit`; `state.batch` keeps counting the epoch's batches from there, so a second reset in
    the same epoch resumes after the batches already done (not at the resumed fit's count)."""
    import keras
    e = hvd.elastic
    model = _model(hvd)
    state = e.KerasState(model, epoch=0, batch=3)
    seen: list[int] = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(state.batch)

    callbacks = [e.UpdateBatchStateCallback(state), e.UpdateEpochStateCallback(state),
                 Record()]
    _fit(model, 2, callbacks=callbacks)  # the epoch's batches 3 and 4 of 5
    assert seen == [4, 5] and state.batch == 0 and state.epoch == 1
    _fit(model, 2, epochs=2, callbacks=callbacks)  # whole epochs count from 0 again
    assert seen[2:] == [1, 2, 1, 2] and state.batch == 0 and state.epoch == 3


def test_run_restores_last_commit_after_failed_collective(hvd) -> None:
    """`hvd.elastic.run` in a size-1 job: a HorovodInternalError rolls the model back to the
    last commit, the runtime is re-initialized, and the function runs again."""
    import keras
    model = _model(hvd)
    state = hvd.elastic.KerasState(model, epoch=0)
    calls: list[int] = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.epoch)
        while state.epoch < 3:
            _fit(model, 2)
            state.epoch += 1
            state.commit()
            if len(calls) == 1 and state.epoch == 2:
                _fit(model, 1)  # not committed: rolled back
                raise hvd.HorovodInternalError("simulated peer failure")
        return _values(model.variables)

    final = train(state)
    assert calls == [0, 2] and hvd.is_initialized()
    ref = _model(hvd)
    _fit(ref, 2, epochs=3)
    assert int(model.optimizer.iterations.numpy()) == 6
    for a, b in zip(final, _values(ref.variables)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    del keras


def test_run_turns_graph_errors_back_into_internal_errors(hvd) -> None:
    """A HorovodInternalError raised inside a tf.function reaches Python as a tf OpError;
    `run` restores the last commit for it as for an eager one, and lets other errors through."""
    import tensorflow as tf

    import horovod.tensorflow as hvd_tf
    v = tf.Variable(1.0)
    state = hvd_tf.elastic.TensorFlowState([v], steps=0)
    calls: list[int] = []

    def fail(x):
        raise hvd.HorovodInternalError("peer 3 died")

    @tf.function
    def step():
        v.assign_add(1.0)
        return tf.py_function(fail, [v], tf.float32)

    @hvd_tf.elastic.run
    def train(state):
        calls.append(state.steps)
        state.steps += 1
        if len(calls) == 1:
            step()
        return float(v.numpy())

    assert train(state) == 1.0 and calls == [0, 0]  # restored: the variable and the counter

    @hvd_tf.elastic.run
    def other(state):
        tf.debugging.assert_equal(tf.constant(1), tf.constant(2))

    with pytest.raises(tf.errors.InvalidArgumentError):
        other(state)


def test_reset_callback_sets_lr_through_keras2_alias(hvd) -> None:
    """Horovod's Keras elastic example rescales the learning rate in its reset callback with
    `tf.keras.backend.set_value(state.model.optimizer.lr, lr * hvd.size())`. Keras 3 dropped
    the `lr` alias (AttributeError, met only once a worker has died); the DistributedOptimizer
    keeps it, and the value set is the one the compiled step uses."""
    import tensorflow as tf
    model = _model(hvd, momentum=0.0)
    state = hvd.elastic.KerasState(model, epoch=0)

    def on_state_reset():
        tf.keras.backend.set_value(state.model.optimizer.lr, 0.05 * hvd.size())
    state.register_reset_callbacks([on_state_reset])
    state.on_reset()
    opt = model.optimizer
    assert float(tf.keras.backend.get_value(opt.lr)) == pytest.approx(0.05)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.05)

    x = np.ones((2, 4), np.float32)
    y = np.zeros((2, 2), np.float32)
    before = _values(model.trainable_variables)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    # Outputs 4 (ones kernel, ones input), so d(mse)/d(output) = 2 * 4 / 4 = 2 per entry and
    # every kernel and bias gradient is 2 rows * 2 = 4: one SGD step moves them by lr * 4.
    for b, a in zip(before, _values(model.trainable_variables)):
        np.testing.assert_allclose(b - a, 0.05 * 4.0, rtol=1e-5)

    opt.lr = 0.2  # the attribute form sets it too
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.2)


def test_compiled_steps_follow_an_elastic_resize(hvd, monkeypatch) -> None:
    # A compiled step traced in a world of one rank used to leave the gradient reduction out
    # and to bake the size in (size_op, sparse averages): after an elastic resize it skipped
    # the others' allreduce or averaged over the old size. In an elastic job the reduction is
    # traced even at size 1, the size is read when the step runs, and a reset makes Keras
    # trace its steps again.
    import tensorflow as tf

    import frameworks.tensorflow._reduce as reduce_mod
    import frameworks.tensorflow.mpi_ops as mpi_ops
    import horovod.tensorflow as hvd_tf

    def step(x, tape_cls=hvd_tf.DistributedGradientTape):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x * x)
        return tape_cls(tape).gradient(loss, [x])[0]

    def py_funcs(fn, *args):
        graph = tf.function(fn).get_concrete_function(*args).graph
        return [op for op in graph.get_operations() if "PyFunc" in op.type]

    x = tf.Variable([1.0, 2.0])
    assert py_funcs(step, x) == []  # not elastic: one rank, nothing to reduce
    monkeypatch.setattr(reduce_mod, "may_resize", lambda: True)
    monkeypatch.setattr(mpi_ops, "may_resize", lambda: True)
    assert py_funcs(step, x), "elastic: the reduction is traced at size 1 too"
    np.testing.assert_allclose(tf.function(step)(x).numpy(), [2.0, 4.0])

    size = tf.function(lambda: hvd_tf.size_op())
    rank = tf.function(lambda: hvd_tf.rank_op())
    assert int(size()) == 1 and int(rank()) == 0
    monkeypatch.setattr(mpi_ops, "process_set_size", lambda ps=None: 3)
    monkeypatch.setattr(mpi_ops.collective, "rank", lambda: 2)
    assert int(size()) == 3  # read when the function runs, not when it was traced
    assert int(rank()) == 2
    monkeypatch.undo()

    model = _model(hvd)
    state = hvd.elastic.KerasState(model)
    _fit(model, 1)
    assert model.train_function is not None
    state.on_reset()
    assert model.train_function is None
    _fit(model, 1)  # traced again


def test_restore_before_the_first_commit_of_a_model_built_late(hvd) -> None:
    # A subclassed model is built by its first batch, after the state's snapshots (none of
    # its variables existed): a failure before the first commit has nothing to roll back to
    # for them. restore() used to raise (the job died on every survivor); they keep their
    # values (the sync after the reset equalises them), the optimizer's committed variables
    # and the other attributes are restored.
    import keras

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Net()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0)
    state.save()  # what run() does after its first sync, still before the first batch
    _fit(model, 2)
    trained = _values(model.variables)
    state.epoch = 3
    state.restore()
    assert state.epoch == 0 and int(model.optimizer.iterations.numpy()) == 0
    for a, b in zip(trained, _values(model.variables)):
        np.testing.assert_array_equal(a, b)
    state.commit()  # from now on there is something to restore
    _fit(model, 1)
    state.restore()
