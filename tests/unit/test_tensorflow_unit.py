"""Single-process tests of the TensorFlow adapter (size 1): the deprecation warning's location
for each way a distributed tape or optimizer is built, compression's contexts, what `join`
returns, the basics in `mpi_ops`, `grouped_reducescatter`'s parameter order, and the set
queries' refusal of an unregistered set."""
from __future__ import annotations

import os
import warnings

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
    import horovod.tensorflow as hvd
    hvd.init()
    yield hvd
    hvd.shutdown()


def test_num_groups_warning_points_at_the_callers_line(hvd):
    import keras
    import tensorflow as tf

    import horovod.tensorflow.keras as hvd_keras
    for make in (
            lambda: hvd.DistributedGradientTape(tf.GradientTape(), num_groups=2),
            lambda: hvd.PartialDistributedGradientTape(tf.GradientTape(), num_groups=2),
            lambda: hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), num_groups=2),
            lambda: hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(), num_groups=2),
            lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), num_groups=2),
            lambda: hvd_keras.DistributedOptimizer(
                keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), num_groups=2),
            lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                             num_groups=2)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        [w] = [w for w in caught if issubclass(w.category, DeprecationWarning)
               and "num_groups" in str(w.message)]
        assert "`num_groups` has been replaced by `groups`" in str(w.message)
        assert (w.filename, w.lineno) == (__file__, make.__code__.co_firstlineno)


def test_compression_context_is_the_input_dtype(hvd):
    """Horovod's ctx is the input's dtype whatever it is: already the wire dtype, or not
    floating; decompress restores it."""
    import tensorflow as tf
    for comp, wire in ((hvd.Compression.fp16, tf.float16), (hvd.Compression.bf16, tf.bfloat16)):
        x = tf.linspace(-2.0, 2.0, 9)
        c, ctx = comp.compress(x)
        assert (c.dtype, ctx) == (wire, tf.float32)
        assert comp.decompress(c, ctx).dtype == tf.float32
        for t in (tf.ones(3, tf.float16), tf.ones(3, tf.bfloat16), tf.range(3)):
            c, ctx = comp.compress(t)
            assert ctx == t.dtype
            assert comp.decompress(c, ctx).dtype == t.dtype
    t = tf.range(3)
    c, ctx = hvd.Compression.none.compress(t)
    assert c is t and ctx is None


def test_elastic_run_gets_a_graph_collectives_own_error_class(hvd):
    # Inside a tf.function a collective's error reaches Python as a tf.errors.OpError; the
    # elastic wrapper raises it again as its own class, so that run() retries a failure but
    # reports a MismatchError (which every new world would meet again) instead of resetting.
    import tensorflow as tf

    from collective.errors import HorovodInternalError, MismatchError, ShutdownError
    from frameworks.tensorflow.elastic import _raise_internal_errors

    def raising(exc):
        def kernel(xs):
            raise exc

        @tf.function
        def step(x):
            return tf.py_function(kernel, [x], [tf.float32])
        return lambda: step(tf.ones(2))

    for exc in (MismatchError("Mismatched allreduce tensor shapes: x"),
                ShutdownError(), HorovodInternalError("rank 1 died")):
        with pytest.raises(type(exc)) as info:
            _raise_internal_errors(raising(exc))()
        assert type(info.value) is type(exc) and str(info.value) == str(exc).splitlines()[0]
    with pytest.raises(tf.errors.OpError):  # not a collective's: TensorFlow's own, as it was
        _raise_internal_errors(raising(KeyError("not ours")))()


def test_auto_jit_compile_means_no_xla_with_a_distributed_optimizer(hvd, monkeypatch):
    # Keras resolves compile(jit_compile="auto") to XLA on a machine with a GPU, where the
    # collectives refuse to run: every unchanged Horovod script's fit failed there. A fake GPU
    # stands in for one.
    import keras
    import tensorflow as tf
    real = tf.config.list_physical_devices

    def with_gpu(*args):
        found = real(*args)
        return found if args else found + [tf.config.PhysicalDevice("/physical_device:GPU:0",
                                                                    "GPU")]
    monkeypatch.setattr(tf.config, "list_physical_devices", with_gpu)

    def model():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ours = model()
    ours.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    assert ours.jit_compile is False
    scaled = model()
    scaled.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))), loss="mse")
    assert scaled.jit_compile is False
    plain = model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert plain.jit_compile is True  # Keras' own rule for other models


def test_the_broadcast_callback_leaves_the_local_gradient_accumulators_alone(hvd, monkeypatch):
    """With backward_passes_per_step > 1 the optimizer sums each rank's own gradients between
    steps in variables of its own; the broadcast after the first batch replaced them with the
    root's (the first update then used the root's first gradient on every rank)."""
    import keras
    import numpy as np
    import horovod.tensorflow.keras as hvd_keras
    from frameworks.tensorflow.keras import callbacks as cb
    sent = []
    monkeypatch.setattr(cb, "broadcast_variables", lambda vs, root: sent.extend(vs))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, epochs=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    accumulators = {id(v) for v in opt._accumulated_gradients}
    assert accumulators and sent
    assert not [v.path for v in sent if id(v) in accumulators]
    assert {id(v) for v in model.trainable_variables} <= {id(v) for v in sent}


def test_keras_optimizer_has_horovods_register_local_var(hvd):
    """Horovod's Keras DistributedOptimizer keeps a variable's gradient local through
    `register_local_var` (the gradient tape's `register_local_source` is accepted too)."""
    import keras
    import horovod.tensorflow.keras as hvd_keras
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1))
    v, w = keras.Variable(1.0), keras.Variable(2.0)
    opt.register_local_var(v)
    opt.register_local_source(w)
    assert opt._hvd_reducer.is_local(v) and opt._hvd_reducer.is_local(w)


def test_tf1_optimizer_has_horovods_register_local_var(hvd):
    """Horovod's wrapped tf.compat.v1 optimizer keeps a variable's gradient local through
    `register_local_var` (it raised AttributeError)."""
    import tensorflow as tf
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    v = tf.Variable(1.0)
    opt.register_local_var(v)
    assert opt._hvd_reducer.is_local(v)


def test_keras_callbacks_device_warns_that_it_has_no_effect(hvd, monkeypatch):
    """docs/tensorflow.md says `device` has no effect; the callbacks stored it silently. They
    warn once, as `device_dense`/`device_sparse` do, at the caller's line."""
    from frameworks.tensorflow import mpi_ops
    import horovod.tensorflow.keras as hvd_keras
    monkeypatch.setattr(mpi_ops, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)
        hvd_keras.callbacks.MetricAverageCallback(device="")
    for make in (lambda: hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0, device="/gpu:0"),
                 lambda: hvd_keras.callbacks.MetricAverageCallback(device="/gpu:0")):
        monkeypatch.setattr(mpi_ops, "_warned", set())
        with pytest.warns(UserWarning, match=r"^device='/gpu:0' has no effect in ringvod") \
                as caught:
            make()
        assert [(w.filename, w.lineno) for w in caught] == [
            (__file__, make.__code__.co_firstlineno)]
        with warnings.catch_warnings():  # once per process
            warnings.simplefilter("error")
            make()


def test_join_returns_an_int32_tensor_eagerly_and_in_a_function(hvd):
    """Horovod's join is an op: a scalar int32 tensor (`hvd.join().numpy()`), also eagerly."""
    import tensorflow as tf
    got = hvd.join()
    assert isinstance(got, tf.Tensor) and got.dtype == tf.int32 and got.shape == []
    assert got.numpy() == 0
    traced = tf.function(hvd.join)()
    assert traced.dtype == tf.int32 and traced.shape == [] and int(traced) == 0


def test_mpi_ops_has_horovods_basics(hvd):
    """`horovod.tensorflow.mpi_ops` defines the basics in Horovod: the same objects here."""
    import horovod.tensorflow.mpi_ops as mpi_ops
    names = ("init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
             "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
             "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
             "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
             "stop_timeline", "ProcessSet", "global_process_set", "add_process_set",
             "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product")
    for name in names:
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
        assert name in mpi_ops.__all__, name
    assert (mpi_ops.is_initialized(), mpi_ops.rank(), mpi_ops.size()) == (True, 0, 1)


def test_grouped_reducescatter_takes_horovods_positional_order(hvd):
    """Horovod's order: (tensors, device_dense, compression, op, process_set, prescale_factor,
    postscale_factor); ringvod's `name` and `ignore_name_scope` come after, keyword-only."""
    import inspect

    import tensorflow as tf
    params = list(inspect.signature(hvd.grouped_reducescatter).parameters.values())
    assert [p.name for p in params[:7]] == ["tensors", "device_dense", "compression", "op",
                                            "process_set", "prescale_factor",
                                            "postscale_factor"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[7:])
    [got] = hvd.grouped_reducescatter([tf.ones([2, 3])], "", hvd.Compression.none, hvd.Sum,
                                      hvd.global_process_set, 2.0, 3.0)
    assert got.numpy().tolist() == [[6.0] * 3] * 2


def test_grouped_allreduce_takes_horovods_positional_order(hvd):
    """Horovod's order after the scale factors: process_set, ignore_name_scope, name."""
    import inspect

    import tensorflow as tf
    names = list(inspect.signature(hvd.grouped_allreduce).parameters)
    assert names[8:] == ["process_set", "ignore_name_scope", "name"], names
    [got] = hvd.grouped_allreduce([tf.ones([2])], None, "", "", hvd.Compression.none, hvd.Sum,
                                  2.0, 3.0, hvd.global_process_set, False, "positional")
    assert got.numpy().tolist() == [6.0, 6.0]


def test_an_unregistered_set_is_refused_by_the_set_queries(hvd):
    """`process_set_included_op` gives 1 for the global set (Horovod's op); a set that is not
    registered is refused, as an unknown id is, rather than read as a membership of 0 or 1.
    `process_set_rank`/`process_set_size` say it is not registered (not "not a member")."""
    loose = hvd.ProcessSet([0])
    assert int(hvd.process_set_included_op()) == 1
    for query in (lambda: hvd.process_set_included_op(process_set=loose),
                  lambda: hvd.mpi_ops.process_set_rank(loose),
                  lambda: hvd.mpi_ops.process_set_size(loose)):
        with pytest.raises(ValueError, match=r"^ProcessSet\(process_set_id=None, ranks=\[0\], "
                                             r"mpi_comm=None\) is not registered"):
            query()
