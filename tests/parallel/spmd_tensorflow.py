"""Rank-side checks of `horovod.tensorflow` / `horovod.tensorflow.keras`, valid at any world size:
every collective and dtype against NumPy references (eagerly and inside `tf.function`),
gradients, helpers, `DistributedGradientTape` and Keras `model.fit` training equality, the
callbacks' effects, `load_model`, `SyncBatchNormalization` and error paths.

One file so that TensorFlow is imported once per rank. The file name keeps plain `pytest` from
collecting it (importing TensorFlow costs seconds); tests/parallel/test_tensorflow.py launches
it at np 1, 2, 4 (MPI) and 2 (tcp), or directly:
`mpirun --allow-run-as-root --oversubscribe -np 2 python -m pytest tests/parallel/spmd_tensorflow.py`
"""
from __future__ import annotations

import os
import tempfile
import zlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import horovod.keras as hvd_keras2  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402
from tests.parallel._util import assert_close, env_size, reference_reduce  # noqa: E402

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(200)]

SIZE = env_size()
PS_EVEN = hvd.ProcessSet(list(range(0, SIZE, 2)))
OPS = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}
DTYPES = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
          tf.float32, tf.float64, tf.bool]
# Inside tf.function the same eager kernel runs (in a py_function): a few dtypes suffice there,
# and each traced function costs TensorFlow tracing time.
GRAPH_DTYPES = {tf.int32, tf.bfloat16, tf.float32, tf.bool}


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init(process_sets=[PS_EVEN])
    tf.config.run_functions_eagerly(False)
    yield


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode()) % 100000


def data(seed: int, r: int, shape, dtype) -> np.ndarray:
    """Rank r's small integer-valued data as NumPy (bfloat16 as float32)."""
    g = np.random.default_rng(seed * 1000 + r)
    if dtype == tf.bool:
        return g.integers(0, 2, shape).astype(bool)
    lo = 0 if dtype in (tf.uint8, tf.uint16) else -3
    np_dt = np.float32 if dtype == tf.bfloat16 else dtype.as_numpy_dtype
    return g.integers(lo, 4, shape).astype(np_dt)


def as_tf(a: np.ndarray, dtype) -> tf.Tensor:
    return tf.cast(tf.constant(a), dtype) if dtype == tf.bfloat16 else tf.constant(a)


def as_np(t: tf.Tensor) -> np.ndarray:
    return tf.cast(t, tf.float32).numpy() if t.dtype == tf.bfloat16 else t.numpy()


def check(got: tf.Tensor, want: np.ndarray, what: str) -> None:
    g = as_np(got)
    if got.dtype == tf.bfloat16:
        np.testing.assert_allclose(g, want.astype(np.float32), rtol=1e-2, atol=1e-2,
                                   err_msg=what)
    else:
        assert_close(g, want.astype(g.dtype), what)


def all_equal(values: np.ndarray, what: str) -> None:
    flat = tf.constant(np.ascontiguousarray(values).reshape(1, -1))
    everyone = hvd.allgather(flat, name=f"all_equal.{what}").numpy()
    assert (everyone == everyone[0]).all(), f"{what} differs across ranks"


# -- basics ---------------------------------------------------------------------------------------
def test_basics_and_aliases():
    assert hvd.is_initialized() and hvd.size() == SIZE and 0 <= hvd.rank() < SIZE
    assert hvd_keras is hvd_keras2 and hvd.keras is hvd_keras
    assert hvd.callbacks is hvd_keras.callbacks
    import frameworks.tensorflow
    assert hvd is frameworks.tensorflow
    assert int(hvd.rank_op()) == hvd.rank() and int(hvd.size_op()) == SIZE
    assert int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.local_size_op()) == hvd.local_size()
    assert int(hvd.process_set_included_op(process_set=PS_EVEN)) == int(hvd.rank() % 2 == 0)
    # Horovod's form: the set by id.
    ps_id = PS_EVEN.process_set_id
    assert int(hvd.process_set_included_op(process_set_id=ps_id)) == int(hvd.rank() % 2 == 0)
    if PS_EVEN.included():
        assert int(hvd.size_op(process_set_id=ps_id)) == len(PS_EVEN.ranks)
    with pytest.raises(ValueError, match="Process set provided does not exist, or has not been "
                                         "registered"):
        hvd.size_op(process_set_id=ps_id + 100)
    assert (hvd.Average, hvd.Sum, hvd.Adasum) == (0, 1, 2)
    assert hvd_keras.size() == SIZE


# -- allreduce ------------------------------------------------------------------------------------
# Each test checks every dtype eagerly and, in ONE tf.function (tracing is slow), a few dtypes
# in graph mode, where the same kernel runs inside a py_function.
def _ops_for(dtype):
    return {k: v for k, v in OPS.items() if not (dtype == tf.bool and k == "avg")}


def test_allreduce_every_dtype_and_op_eager_and_graph():
    me = hvd.rank()
    parts = {d: [data(seed_of("ar", d.name), r, (3, 5), d) for r in range(SIZE)] for d in DTYPES}
    xs = {d: as_tf(parts[d][me], d) for d in DTYPES}
    for d in DTYPES:
        for k, op in _ops_for(d).items():
            check(hvd.allreduce(xs[d], op=op), reference_reduce(parts[d], op),
                  f"eager {d.name} {k}")
        if d == tf.bool:
            with pytest.raises(ValueError, match="bool"):
                hvd.allreduce(xs[d], op=hvd.Average)
    gd = sorted(GRAPH_DTYPES, key=lambda d: d.name)

    @tf.function
    def graph(ts):
        return [[hvd.allreduce(t, op=op, name=f"g.{d.name}.{k}") for k, op in _ops_for(d).items()]
                for d, t in zip(gd, ts)]
    for d, outs in zip(gd, graph([xs[d] for d in gd])):
        for (k, op), g in zip(_ops_for(d).items(), outs):
            assert g.shape == (3, 5)
            check(g, reference_reduce(parts[d], op), f"graph {d.name} {k}")


def test_allreduce_scaling_grouped_variable_compression():
    me = hvd.rank()
    parts = [data(1, r, (4,), tf.float32) for r in range(SIZE)]
    x = tf.constant(parts[me])
    check(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
          reference_reduce(parts, hvd.Sum, 2.0, 0.5), "scaled")
    check(hvd.allreduce(tf.Variable(x)), reference_reduce(parts, hvd.Average), "variable")
    check(hvd.allreduce(x, compression=hvd.Compression.fp16),
          reference_reduce(parts, hvd.Average), "fp16")
    assert hvd.allreduce(x, compression=hvd.Compression.fp16).dtype == tf.float32
    ints = [data(2, r, (2, 2), tf.int64) for r in range(SIZE)]
    outs = hvd.grouped_allreduce([x, tf.constant(ints[me])], op=hvd.Sum)
    check(outs[0], reference_reduce(parts, hvd.Sum), "grouped f32")
    check(outs[1], reference_reduce(ints, hvd.Sum), "grouped i64")

    @tf.function
    def graph(a, b):
        return hvd.grouped_allreduce([a, b], op=hvd.Sum)
    outs = graph(x, tf.constant(ints[me]))
    check(outs[1], reference_reduce(ints, hvd.Sum), "graph grouped i64")


def test_indexed_slices_allgathered_or_dense():
    me = hvd.rank()
    vals = tf.constant([[float(me + 1), 1.0]])
    sl = tf.IndexedSlices(vals, tf.constant([me % 3]), dense_shape=tf.constant([3, 2]))
    # Scale factors are refused (Horovod's error) before anything is sent: the checks below
    # still pair up across ranks.
    refused = "Pre/postscale_factor are not supported with tf.IndexedSlices"
    for factors in ({"prescale_factor": 2.0}, {"postscale_factor": 0.5}):
        with pytest.raises(NotImplementedError, match=refused):
            hvd.allreduce(sl, name="scaled_slices", **factors)
        with pytest.raises(NotImplementedError, match=refused):
            hvd.grouped_allreduce([tf.constant([1.0]), sl], **factors)
    out = hvd.allreduce(sl, op=hvd.Sum)
    assert isinstance(out, tf.IndexedSlices)
    assert out.values.shape == (SIZE, 2)
    np.testing.assert_array_equal(out.indices.numpy(), [r % 3 for r in range(SIZE)])
    dense = tf.convert_to_tensor(hvd.allreduce(sl))  # Average
    want = np.zeros((3, 2), np.float32)
    for r in range(SIZE):
        want[r % 3] += [r + 1, 1.0]
    np.testing.assert_allclose(dense.numpy(), want / SIZE, rtol=1e-6)
    # A predivide factor splits the gradient average into scale factors; allgathered sparse
    # gradients need none, so they still reduce (where allreduce refuses the factors).
    emb = tf.Variable(tf.ones([3, 2]))
    with tf.GradientTape() as tape:
        loss = (me + 1.0) * tf.reduce_sum(tf.gather(emb, [me % 3]))
    grad = hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0).gradient(loss, [emb])
    np.testing.assert_allclose(tf.convert_to_tensor(grad[0]).numpy(), want[:, :1] / SIZE
                               * np.ones((1, 2), np.float32), rtol=1e-6)


# -- allgather / broadcast / alltoall / reducescatter ------------------------------------------
def _graph_check(fn, xs: dict, wants: dict, what: str) -> None:
    """Runs `fn(t, dtype)` for every graph dtype inside one tf.function; checks each output."""
    gd = sorted(GRAPH_DTYPES, key=lambda d: d.name)
    outs = tf.function(lambda ts: [fn(t, d) for d, t in zip(gd, ts)])([xs[d] for d in gd])
    for d, g in zip(gd, outs):
        check(g, wants[d], f"graph {what} {d.name}")


def test_allgather_every_dtype_uneven_eager_and_graph():
    me = hvd.rank()
    parts = {d: [data(seed_of("ag", d.name), r, (r + 1, 2), d) for r in range(SIZE)]
             for d in DTYPES}
    xs = {d: as_tf(parts[d][me], d) for d in DTYPES}
    wants = {d: np.concatenate(parts[d]) for d in DTYPES}
    for d in DTYPES:
        check(hvd.allgather(xs[d]), wants[d], f"eager {d.name}")
    _graph_check(lambda t, d: hvd.allgather(t, name=f"ag.{d.name}"), xs, wants, "allgather")
    a, b = hvd.grouped_allgather([tf.constant([me]), tf.constant([[me, me]])])
    np.testing.assert_array_equal(a.numpy(), np.arange(SIZE))
    assert b.shape == (SIZE, 2)


def test_broadcast_every_dtype_and_root():
    me = hvd.rank()
    parts = {d: [data(seed_of("bc", d.name), r, (2, 3), d) for r in range(SIZE)] for d in DTYPES}
    xs = {d: as_tf(parts[d][me], d) for d in DTYPES}
    for d in DTYPES:
        for root in range(SIZE):
            check(hvd.broadcast(xs[d], root), parts[d][root], f"eager {d.name} root {root}")
    _graph_check(lambda t, d: hvd.broadcast(t, SIZE - 1, name=f"bc.{d.name}"), xs,
                 {d: parts[d][SIZE - 1] for d in DTYPES}, "broadcast")
    v = tf.Variable([float(me)] * 3)
    assert hvd.broadcast_(v, 0) is v
    np.testing.assert_array_equal(v.numpy(), [0.0] * 3)
    vs = [tf.Variable([me]), tf.Variable([[float(me)]])]

    @tf.function
    def graph_bcast():
        hvd.broadcast_(vs, SIZE - 1, name="bcast_vars")
    graph_bcast()
    assert vs[0].numpy()[0] == SIZE - 1 and vs[1].numpy()[0, 0] == SIZE - 1


def test_alltoall_splits_eager_and_graph():
    me = hvd.rank()
    splits = [me + d + 1 for d in range(SIZE)]  # rank r sends r + d + 1 rows (all r) to rank d

    def fill(d, value, rows):
        v = value % 2 if d == tf.bool else value
        dt = np.float32 if d == tf.bfloat16 else d.as_numpy_dtype
        return np.full((rows, 2), v).astype(dt)
    xs = {d: as_tf(fill(d, me, sum(splits)), d) for d in DTYPES}
    wants = {d: np.concatenate([fill(d, r, r + me + 1) for r in range(SIZE)]) for d in DTYPES}
    for d in DTYPES:
        out, received = hvd.alltoall(xs[d], splits=splits)
        check(out, wants[d], f"eager {d.name}")
        np.testing.assert_array_equal(received.numpy(), [r + me + 1 for r in range(SIZE)])
    _graph_check(lambda t, d: hvd.alltoall(t, splits=splits, name=f"a2a.{d.name}")[0], xs,
                 wants, "alltoall")
    even = hvd.alltoall(tf.constant(np.full((SIZE * 2,), me, np.int32)))
    np.testing.assert_array_equal(even.numpy(), np.repeat(np.arange(SIZE), 2))


def test_reducescatter_sum_average_uneven_grouped():
    me = hvd.rank()
    rows = 2 * SIZE + 1
    share = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    lo = sum(share[:me])
    rs_dtypes = [tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
    parts = {d: [data(seed_of("rs", d.name), r, (rows, 3), d) for r in range(SIZE)]
             for d in rs_dtypes}
    xs = {d: as_tf(parts[d][me], d) for d in rs_dtypes}
    for d in rs_dtypes:
        for op in (hvd.Sum, hvd.Average):
            want = reference_reduce(parts[d], op)[lo:lo + share[me]]
            check(hvd.reducescatter(xs[d], op=op), want, f"eager {d.name} {op}")
    g = tf.function(lambda t: hvd.reducescatter(t, op=hvd.Sum, name="rs"))(xs[tf.float32])
    assert g.shape == (share[me], 3), "static shape"
    check(g, reference_reduce(parts[tf.float32], hvd.Sum)[lo:lo + share[me]], "graph")
    a, b = hvd.grouped_reducescatter([tf.ones([SIZE, 2]), tf.ones([SIZE])], op=hvd.Sum)
    np.testing.assert_array_equal(a.numpy(), np.full((1, 2), SIZE))
    np.testing.assert_array_equal(b.numpy(), [SIZE])


# -- gradients ------------------------------------------------------------------------------------
def _all_grads(x, xs, xa, xr):
    """Gradients of sum(y * w) through each collective (w = 1..n / n over y's elements)."""
    def grad(fn, t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = tf.reshape(fn(t), [-1])
            loss = tf.reduce_sum(y * tf.range(1, tf.size(y) + 1, dtype=y.dtype)
                                 / tf.cast(tf.size(y), y.dtype))
        return tape.gradient(loss, t)
    return [grad(lambda t: hvd.allreduce(t, op=hvd.Sum, name="gr.sum"), x),
            grad(lambda t: hvd.allreduce(t, name="gr.avg"), x),
            grad(lambda t: hvd.allgather(t, name="gr.ag"), xs),
            grad(lambda t: hvd.broadcast(t, 0, name="gr.bc"), x),
            grad(lambda t: hvd.alltoall(t, name="gr.a2a"), xa),
            grad(lambda t: hvd.reducescatter(t, op=hvd.Sum, name="gr.rs"), xr)]


def test_gradients_of_the_collectives():
    me = hvd.rank()
    x = tf.constant(np.arange(4, dtype=np.float32) + me)
    xs = tf.constant(np.ones((me + 1, 1), np.float32))
    xa = tf.constant(np.ones(SIZE * 2, np.float32))
    xr = tf.constant(np.ones(SIZE, np.float32))
    w = (np.arange(1, 5) / 4).astype(np.float32)
    total = sum(r + 1 for r in range(SIZE))
    wg = (np.arange(1, total + 1) / total).astype(np.float32)
    lo = sum(r + 1 for r in range(me))
    wa = (np.arange(1, 2 * SIZE + 1) / (2 * SIZE)).astype(np.float32)
    want = [w * SIZE,                         # allreduce(Sum): allreduce(Sum) of the gradient
            w,                                # allreduce(Average)
            wg[lo:lo + me + 1, None],         # allgather: Average allreduce, this rank's rows
            w if me == 0 else 0 * w,          # broadcast: Average allreduce, zero off the root
            np.tile(wa[2 * me:2 * me + 2], SIZE),  # alltoall: alltoall with received splits
            np.full(SIZE, SIZE, np.float32)]  # reducescatter(Sum): allgather, times the size
    for mode, fn in (("eager", _all_grads), ("graph", tf.function(_all_grads))):
        for i, (g, wt) in enumerate(zip(fn(x, xs, xa, xr), want)):
            np.testing.assert_allclose(g.numpy(), wt, rtol=1e-6, err_msg=f"{mode} {i}")


def test_gradients_through_an_index_and_of_unsent_rows():
    """An output used through tf.gather sends back IndexedSlices: the collectives take them
    dense (they raised); alltoall's gradient has the input's rows, zeros for rows the splits
    left unsent (it had only the sent ones: a shape error in the sum)."""
    me = hvd.rank()
    table = tf.constant(np.arange(6, dtype=np.float32).reshape(3, 2) + me)

    def through_gather(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = hvd.allgather(t, name="gr.ag.gather")
            loss = tf.reduce_sum(tf.gather(y, [0, 2]))
        return tape.gradient(loss, t)

    def unsent(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            out, _ = hvd.alltoall(t, splits=[1] * SIZE, name="gr.a2a.unsent")
            loss = tf.reduce_sum(out) + tf.reduce_sum(t)  # the unsent rows' own term
        return tape.gradient(loss, t)

    # Rows 0 and 2 of the gathered table are rank 0's rows 0 and 2: every rank's gradient
    # there is 1, and their average too.
    want_gather = np.zeros((3, 2), np.float32)
    if me == 0:
        want_gather[[0, 2]] = 1.0
    x = tf.ones([SIZE + 2, 2])
    want_unsent = np.concatenate([np.full((SIZE, 2), 2.0), np.ones((2, 2))]).astype(np.float32)
    for mode, g, u in (("eager", through_gather, unsent),
                       ("graph", tf.function(through_gather), tf.function(unsent))):
        np.testing.assert_allclose(g(table).numpy(), want_gather, err_msg=mode)
        np.testing.assert_allclose(u(x).numpy(), want_unsent, err_msg=mode)


# -- helpers --------------------------------------------------------------------------------------
def test_broadcast_and_allgather_objects_and_variables():
    me = hvd.rank()
    obj = {"rank": me, "f": (lambda: 42) if me == 0 else None}
    got = hvd.broadcast_object(obj, 0)
    assert got["rank"] == 0 and got["f"]() == 42
    assert hvd.broadcast_object_fn(root_rank=SIZE - 1, name="fn")(me) == SIZE - 1
    assert hvd.allgather_object({"r": me}) == [{"r": r} for r in range(SIZE)]
    vs = [tf.Variable(np.full((2, 2), me, np.float32)), tf.Variable([me], dtype=tf.int64)]
    hvd.broadcast_variables(vs, root_rank=SIZE - 1)
    assert (vs[0].numpy() == SIZE - 1).all() and vs[1].numpy()[0] == SIZE - 1
    with pytest.raises(ValueError, match="session"):
        hvd.broadcast_object(1, session=object())


# -- training equality -------------------------------------------------------------------------
def _model(seed: int = 7, bn: bool = False):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh")]
    if bn:
        layers.append(hvd.SyncBatchNormalization())
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)


def _dataset(n: int):
    g = np.random.default_rng(3)
    x = g.standard_normal((n, 6)).astype(np.float32)
    y = (x @ g.standard_normal((6, 1)) + 0.1).astype(np.float32)
    return x, y


def _weights(model) -> np.ndarray:
    return np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])


def test_custom_loop_distributed_gradient_tape_equals_full_batch():
    me, per = hvd.rank(), 4
    x, y = _dataset(per * SIZE * 3)
    model, ref = _model(), _model()
    opt, ref_opt = keras.optimizers.SGD(0.05, momentum=0.5), keras.optimizers.SGD(0.05,
                                                                                  momentum=0.5)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for i in range(3):
        lo = i * per * SIZE
        step(x[lo + me * per: lo + (me + 1) * per], y[lo + me * per: lo + (me + 1) * per])
        with tf.GradientTape() as tape:
            loss = loss_fn(y[lo:lo + per * SIZE], ref(x[lo:lo + per * SIZE], training=True))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                    ref.trainable_variables))
    w = _weights(model)
    all_equal(w, "tape weights")
    np.testing.assert_allclose(w, _weights(ref), rtol=1e-5, atol=1e-6)


def test_tape_local_sources_and_partial_tape():
    me = hvd.rank()
    a, b = tf.Variable([1.0]), tf.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = (me + 1.0) * (a[0] + b[0])
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(b)
    ga, gb = tape.gradient(loss, [a, b])
    np.testing.assert_allclose(ga.numpy(), [np.mean(np.arange(1, SIZE + 1))], rtol=1e-6)
    np.testing.assert_allclose(gb.numpy(), [(me + 1.0) / SIZE], rtol=1e-6)
    layer = keras.layers.Dense(1)
    layer.build((None, 1))
    with tf.GradientTape() as tape:
        loss = (me + 1.0) * tf.reduce_sum(layer(tf.ones((1, 1))))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[layer],
                                              scale_local_gradients=False)
    local, glob = tape.get_local_and_global_gradients(loss, layer.trainable_weights,
                                                      use_generic_names=False)
    assert len(local) == 2 and glob == []  # Horovod's (source, gradient) pairs
    assert [s is w for (s, _), w in zip(local, layer.trainable_weights)] == [True, True]
    np.testing.assert_allclose(local[1][1].numpy(), [me + 1.0], rtol=1e-6)


def test_tape_gradient_none_on_some_ranks_only_is_reduced():
    """A source that only rank 0's loss uses has a gradient on rank 0 and None elsewhere: the
    ranks agree (eagerly) and reduce zeros for the missing ones (it used to hang every rank)."""
    me = hvd.rank()
    a, b = tf.Variable([1.0]), tf.Variable([2.0])
    emb = tf.Variable(tf.ones([4, 2]))
    with tf.GradientTape() as tape:
        loss = 3.0 * a[0]
        if me == 0:
            loss += 2.0 * b[0] + tf.reduce_sum(tf.gather(emb, [1, 2]))
    ga, gb, ge = hvd.DistributedGradientTape(tape).gradient(loss, [a, b, emb])
    np.testing.assert_allclose(ga.numpy(), [3.0])
    np.testing.assert_allclose(gb.numpy(), [2.0 / SIZE])
    want = np.zeros((4, 2), np.float32)
    want[1:3] = 1.0 / SIZE
    np.testing.assert_allclose(tf.convert_to_tensor(ge).numpy(), want)
    with tf.GradientTape() as tape:  # None on every rank stays None
        loss = 3.0 * a[0]
    assert hvd.DistributedGradientTape(tape).gradient(loss, [a, b])[1] is None
    if SIZE > 1:  # sources lists of different lengths: an error on every rank (was a hang)
        with tf.GradientTape() as tape:
            loss = 3.0 * a[0]
        with pytest.raises(hvd.HorovodInternalError, match="different numbers of gradients"):
            hvd.DistributedGradientTape(tape).gradient(loss, [a] * (me + 1))


def test_tape_reduced_gradients_are_differentiable():
    """An outer tape differentiates DistributedGradientTape's reduced gradients as it does an
    allreduce (the gradient of the reduction is the same reduction); it used to get None."""
    me = hvd.rank()
    x = tf.Variable([1.0, 2.0])

    def second(op):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(x ** 3) * (me + 1.0)
            g = hvd.DistributedGradientTape(inner, op=op).gradient(loss, x)
        return g, outer.gradient(g, x)
    for mode, fn in (("eager", second), ("graph", tf.function(second))):
        for op, factor in ((hvd.Average, 1.0), (hvd.Sum, float(SIZE))):
            g, h = fn(op)
            mean = np.mean(np.arange(1, SIZE + 1))
            np.testing.assert_allclose(g.numpy(), 3 * x.numpy() ** 2 * mean * factor,
                                       err_msg=f"{mode} {op}")
            np.testing.assert_allclose(h.numpy(), 6 * x.numpy() * (me + 1) * factor,
                                       err_msg=f"{mode} {op}")


def test_keras_fit_with_distributed_optimizer_and_callbacks_equals_full_batch():
    me, per, steps = hvd.rank(), 4, 3
    x, y = _dataset(per * SIZE * steps)
    shard = np.concatenate([np.arange(s * per * SIZE + me * per, s * per * SIZE + (me + 1) * per)
                            for s in range(steps)])
    model, ref = _model(), _model()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
    model.compile(optimizer=opt, loss="mse")
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
           hvd.callbacks.MetricAverageCallback()]
    hist = model.fit(x[shard], y[shard], batch_size=per, epochs=2, shuffle=False, verbose=0,
                     callbacks=cbs)
    ref.fit(x, y, batch_size=per * SIZE, epochs=2, shuffle=False, verbose=0)
    w = _weights(model)
    all_equal(w, "fit weights")
    np.testing.assert_allclose(w, _weights(ref), rtol=2e-5, atol=1e-6)
    all_equal(np.array(hist.history["loss"]), "averaged loss")


def test_backward_passes_per_step_accumulates_then_reduces():
    me, per = hvd.rank(), 2
    x, y = _dataset(per * SIZE * 2)
    model, ref = _model(), _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     backward_passes_per_step=2,
                                                     average_aggregated_gradients=True),
                  loss="mse")
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mine = np.concatenate([np.arange(s * per * SIZE + me * per, s * per * SIZE + (me + 1) * per)
                           for s in range(2)])
    model.fit(x[mine], y[mine], batch_size=per, epochs=1, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=per * SIZE * 2, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(_weights(model), _weights(ref), rtol=2e-5, atol=1e-6)
    assert model.optimizer.get_config()["gradient_accumulation_steps"] is None


class TwoHeads(keras.Model):
    """Two same-shaped Dense heads; `call` uses `pick(rank)`'s head only (the other has no
    gradient), so its variables are in trainable_variables but may have None gradients."""

    def __init__(self, pick):
        super().__init__()
        self.pick = pick
        self.a, self.b = keras.layers.Dense(1, name="a"), keras.layers.Dense(1, name="b")
        self.a.build((None, 6))
        self.b.build((None, 6))

    def call(self, x):
        return self.a(x) if self.pick(hvd.rank()) == "a" else self.b(x)


def test_keras_variable_without_a_gradient_is_left_alone():
    # As in plain Keras, a variable that no rank has a gradient for is not updated: weight
    # decay (AdamW) and momentum left head "b" alone, compiled and eagerly (it used to be
    # reduced as zeros and decayed).
    x, y = _dataset(8 * SIZE)
    for eager in (False, True):
        keras.utils.set_random_seed(5)
        model = TwoHeads(lambda r: "a")
        before = [v.numpy().copy() for v in model.b.trainable_variables]
        a_before = model.a.kernel.numpy().copy()
        model.compile(optimizer=hvd_keras.DistributedOptimizer(
            keras.optimizers.AdamW(0.01, weight_decay=0.5)), loss="mse", run_eagerly=eager)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        for v, b in zip(model.b.trainable_variables, before):
            np.testing.assert_array_equal(v.numpy(), b)
        assert not np.array_equal(model.a.kernel.numpy(), a_before)


def test_keras_gradient_on_some_ranks_only():
    # Eagerly, head "b" has a gradient on rank 0 only: the other ranks reduce zeros for it
    # (no hang) and every rank applies the same average. Compiled, the gradients' kinds are
    # fixed at tracing: ranks that traced gradients for other variables get an error on every
    # rank (before, their gradients of different variables were reduced together).
    if SIZE == 1:
        return
    x, y = _dataset(8 * SIZE)
    me = hvd.rank()
    keras.utils.set_random_seed(6)
    model = TwoHeads(lambda r: "b" if r == 0 else "a")
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse", run_eagerly=True)
    model.fit(x[me * 8:(me + 1) * 8], y[me * 8:(me + 1) * 8], batch_size=4, epochs=1,
              shuffle=False, verbose=0)
    all_equal(_weights(model), "eager weights")
    keras.utils.set_random_seed(6)
    model = TwoHeads(lambda r: "b" if r == 0 else "a")
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse")
    with pytest.raises(tf.errors.UnknownError, match="Mismatched ALLREDUCE tensor layouts"):
        model.fit(x[:4], y[:4], batch_size=4, epochs=1, shuffle=False, verbose=0)


def test_compiled_tape_with_a_sparse_gradient_on_some_ranks_only_fails_everywhere():
    # Inside a tf.function rank 0 uses the embedding through tf.gather (a sparse gradient),
    # the others do not: the dense reduction, which carries the kinds' digest, runs before the
    # sparse allgathers, so every rank gets the mismatch error (rank 0 waited in its sparse
    # allgather, the others in the dense one: a stall).
    if SIZE == 1:
        return
    me = hvd.rank()
    emb, w = tf.Variable(tf.ones([4, 2])), tf.Variable([1.0, 2.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
            if me == 0:
                loss += tf.reduce_sum(tf.gather(emb, [1, 3]))
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, [emb, w])

    with pytest.raises((tf.errors.UnknownError, hvd.HorovodInternalError),
                       match="Mismatched ALLREDUCE tensor layouts"):
        step()


def test_loss_scale_optimizer_reduces_and_skips_on_every_rank():
    me = hvd.rank()
    scale = 2.0 ** 15
    # Wrapping a LossScaleOptimizer reduces in its inner optimizer (it used to reduce nothing).
    v = keras.Variable(np.zeros(2, np.float32))
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=scale))
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer) and opt.initial_scale == scale
    opt.apply([tf.fill([2], scale * (me + 1))], [v])
    np.testing.assert_allclose(v.numpy(), [-(SIZE + 1) / 2] * 2)
    # One rank's non-finite gradients make every rank skip the step (it used to hang).
    w = keras.Variable(np.zeros(2, np.float32))
    lso = keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(
        keras.optimizers.SGD(1.0)), initial_scale=scale)
    lso.apply([tf.fill([2], np.inf if me == 0 else 1.0)], [w])
    assert int(lso.iterations.numpy()) == 0 and float(lso.dynamic_scale.numpy()) == scale / 2
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.0])
    lso.apply([tf.fill([2], scale / 2 * (me + 1))], [w])
    np.testing.assert_allclose(w.numpy(), [-(SIZE + 1) / 2] * 2)
    # The same inside model.fit's compiled step.
    model = _model()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))), loss="mse")
    x, y = _dataset(8)
    before = _weights(model)
    model.fit(x * (np.inf if me == 0 else 1.0), y, batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(_weights(model), before)


# -- callbacks' effects --------------------------------------------------------------------------
class _Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs, self.moms, self.logs = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        self.lrs.append(float(keras.ops.convert_to_numpy(opt.learning_rate)))
        m = opt.momentum
        self.moms.append(m.get() if hasattr(m, "get") else float(m))

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


class _RankMetric(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["rank_metric"] = float(hvd.rank())
        # A per-class metric (F1Score(average=None)): a vector, averaged too (it stayed local).
        logs["rank_vector"] = np.array([hvd.rank(), 2.0 * hvd.rank(), 7.0])


def test_broadcast_callback_after_first_batch_and_metric_average():
    me = hvd.rank()
    model = _model(seed=100 + me)  # different weights on every rank
    root_w = hvd.broadcast_object(_weights(model), 0, name="root_w")
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    rec = _Record()
    x, y = _dataset(8)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[_RankMetric(), hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(), rec])
    np.testing.assert_array_equal(_weights(model), root_w)  # lr 0: only the broadcast moved them
    assert rec.logs[0]["rank_metric"] == pytest.approx((SIZE - 1) / 2)
    np.testing.assert_allclose(rec.logs[0]["rank_vector"], [(SIZE - 1) / 2, SIZE - 1, 7.0])


def test_broadcast_callback_leaves_each_ranks_dropout_masks():
    # Keras 3 keeps a Dropout layer's random state in a variable of model.variables: broadcast,
    # every rank would draw the root's masks for the rest of training.
    drop = keras.layers.Dropout(0.5, seed=None)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), drop])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    x = np.random.RandomState(hvd.rank()).rand(8, 8).astype("float32")
    model.fit(x, x, batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    state = drop._seed_generators[0].state.numpy()
    states = hvd.allgather_object(state.tolist(), name="seed.states")
    assert len({tuple(s) for s in states}) == SIZE, states


def test_broadcast_variables_leaves_each_ranks_seed_generators():
    # The custom-loop form (`hvd.broadcast_variables(model.variables, root_rank=0)`, as in
    # Horovod's TF2 examples): model.variables lists Keras 3's SeedGenerator state, which
    # broadcast gave every rank the root's dropout masks. The weights are the root's.
    drop = keras.layers.Dropout(0.5, seed=None)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), drop])
    model(np.ones((2, 8), np.float32), training=True)
    hvd.broadcast_variables(model.variables, root_rank=0)
    kernels = hvd.allgather_object(model.layers[0].kernel.numpy().tolist(), name="bv.kernels")
    assert all(k == kernels[0] for k in kernels)
    states = hvd.allgather_object(drop._seed_generators[0].state.numpy().tolist(),
                                  name="bv.seed.states")
    assert len({tuple(s) for s in states}) == SIZE, states


def test_distributed_optimizer_of_an_optimizer_doing_arithmetic_on_momentum():
    # Only SGD's and RMSprop's momentum becomes live (LiveMomentum); Muon computes
    # `self.momentum - 1`, which failed with a TypeError inside fit.
    muon = getattr(keras.optimizers, "Muon", None)
    if muon is None:
        pytest.skip("this Keras has no Muon")
    x, y = _dataset(8)
    model = _model()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(muon(learning_rate=0.01)),
                  loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    all_equal(_weights(model), "muon weights")


def test_broadcast_callback_keeps_local_variables():
    """`local_variables` takes one variable (Horovod accepts a lone tf.Variable; iterating it
    used to raise) or a list, and a Keras variable's backing `tf.Variable` excludes it too."""
    me = hvd.rank()
    x, y = _dataset(8)
    for local in ("one", "backing"):
        model = _model(seed=200 + me)  # different weights on every rank
        kernel, bias = model.layers[-1].kernel, model.layers[-1].bias
        mine = kernel.numpy().copy()
        root_first = hvd.broadcast_object(model.layers[0].kernel.numpy(), 0, name=f"lv.{local}")
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(
            0, local_variables=kernel if local == "one" else [kernel.value])
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
        np.testing.assert_array_equal(kernel.numpy(), mine, err_msg=local)
        np.testing.assert_array_equal(model.layers[0].kernel.numpy(), root_first, err_msg=local)
        all_equal(bias.numpy(), f"broadcast bias {local}")
    with pytest.raises(ValueError, match="tf.Variable"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=["kernel"])


def test_warmup_verbose_prints_on_rank_0_only(capsys):
    x, y = _dataset(8)
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    warm = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1, verbose=1)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[warm])
    out = capsys.readouterr().out
    assert ("finished gradual learning rate warmup" in out) == (hvd.rank() == 0), out


def test_learning_rate_schedules_and_momentum_correction():
    x, y = _dataset(16)
    model = _model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    sched = hvd.callbacks.LearningRateScheduleCallback(0.1, lambda e: 0.5 ** e, staircase=True)
    rec = _Record()
    model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[sched, rec])
    assert rec.lrs == pytest.approx([0.1] * 4 + [0.05] * 4 + [0.025] * 4)
    # momentum corrected (x new/old lr) for the batch where lr changes, restored after
    assert rec.moms[:5] == pytest.approx([0.9] * 4 + [0.45])
    assert rec.moms[5] == pytest.approx(0.9) and opt.momentum.get() == pytest.approx(0.9)
    per_batch = hvd.callbacks.LearningRateScheduleCallback(
        0.1, lambda e: 1.0 / (1.0 + e), staircase=False, momentum_correction=False)
    rec = _Record()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[per_batch, rec])
    want = [0.1 / (1 + e + b / 4) for e in range(2) for b in range(4)]
    assert rec.lrs == pytest.approx(want)
    warm = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2,
                                                    momentum_correction=False)
    rec = _Record()
    model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[warm, rec])
    ramp = [0.1 / SIZE * ((e + b / 4 + 0.25) * (SIZE - 1) / 2 + 1)
            for e in range(2) for b in range(4)]
    assert rec.lrs[:8] == pytest.approx(ramp)
    assert rec.logs[1]["lr"] == pytest.approx(0.1)


def test_momentum_correction_under_mixed_precision():
    """`compile` puts a LossScaleOptimizer (no `momentum` of its own) around the optimizer under
    mixed_float16: the correction reaches the inner optimizer's momentum (it used to be
    skipped)."""
    x, y = _dataset(8)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                      loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    moms = []
    rec = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: moms.append(
        model.optimizer.inner_optimizer.momentum.get()))
    sched = hvd.callbacks.LearningRateScheduleCallback(0.1, lambda e: 0.5 ** e)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[sched, rec])
    assert moms == pytest.approx([0.9, 0.9, 0.45, 0.9])
    assert model.optimizer.inner_optimizer.momentum.get() == pytest.approx(0.9)


# -- load_model, SyncBatchNormalization -----------------------------------------------------------
def test_load_model_round_trip_rewraps_the_optimizer():
    me = hvd.rank()
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9),
                                                     compression=hvd.Compression.fp16),
                  loss="mse")
    x, y = _dataset(8)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "model.keras")
                                if me == 0 else None, 0, name="path")
    if me == 0:
        model.save(path)
    hvd.allgather_object(None, name="saved")  # a barrier
    loaded = hvd_keras.load_model(path)
    from frameworks.tensorflow.keras.optimizer import _DistributedOptimizerMixin
    assert isinstance(loaded.optimizer, _DistributedOptimizerMixin)
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    np.testing.assert_array_equal(_weights(loaded), _weights(model))
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    plain = keras.models.load_model(path)
    assert not isinstance(plain.optimizer, _DistributedOptimizerMixin)
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)
    all_equal(_weights(loaded), "loaded weights")


def test_load_model_refuses_an_h5_optimizer_and_says_what_to_do():
    """Keras 3 drops an HDF5 file's optimizer state (the loaded model cannot train) and would
    hand the optimizer back unwrapped: a clear error instead; the weights alone still load."""
    me = hvd.rank()
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss=keras.losses.MeanSquaredError())
    x, y = _dataset(8)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    folder = hvd.broadcast_object(tempfile.mkdtemp() if me == 0 else None, 0, name="h5dir")
    path, bare = os.path.join(folder, "model.h5"), os.path.join(folder, "bare.h5")
    if me == 0:
        model.save(path)
        model.save(bare, include_optimizer=False)
    hvd.allgather_object(None, name="h5saved")  # a barrier
    with pytest.raises(ValueError, match=r"HDF5 file .*model\.h5.*Save the model as \.keras"):
        hvd_keras.load_model(path)
    weights_only = hvd_keras.load_model(path, compile=False)
    np.testing.assert_array_equal(_weights(weights_only), _weights(model))
    np.testing.assert_array_equal(_weights(hvd_keras.load_model(bare)), _weights(model))


def test_sync_batch_normalization_uses_every_rank_batch():
    me = hvd.rank()
    g = np.random.default_rng(5)
    full = g.standard_normal((4 * SIZE, 3)).astype(np.float32)
    layer = hvd.SyncBatchNormalization(momentum=0.0, epsilon=1e-5)
    out = layer(full[4 * me:4 * me + 4], training=True).numpy()
    want = (full - full.mean(0)) / np.sqrt(full.var(0) + 1e-5)
    np.testing.assert_allclose(out, want[4 * me:4 * me + 4], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), full.mean(0), rtol=1e-4, atol=1e-5)


# -- error paths ---------------------------------------------------------------------------------
def test_error_paths():
    me = hvd.rank()
    with pytest.raises(ValueError, match="complex64 is not supported"):
        hvd.allreduce(tf.constant([1 + 1j], tf.complex64))
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(tf.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(hvd.HorovodInternalError, match="AVERAGE and SUM"):
        hvd.reducescatter(tf.ones(2), op=hvd.Max)
    with pytest.raises(ValueError, match="32-bit integer"):
        hvd.alltoall(tf.ones(2), splits=[0.5] * SIZE)
    # Splits are never truncated: non-integral values fail at the call (eagerly, and while
    # tracing when they are constants), naming the tensor and rank; whole floats are counts.
    x = tf.range(2.0 * SIZE)
    for i, bad in enumerate(([1.5] + [0.5] * (SIZE - 1), tf.fill([SIZE], 0.5), [True] * SIZE)):
        with pytest.raises(ValueError, match="32-bit integer elements") as info:
            hvd.alltoall(x, splits=bad, name=f"a2a.bad.{i}")
        for part in (f"a2a.bad.{i}", f"rank {me}", "whole", "2.0"):
            assert part in str(info.value), (part, str(info.value))
    with pytest.raises(ValueError, match="32-bit integer elements"):
        tf.function(lambda t: hvd.alltoall(t, splits=[0.5] * SIZE, name="a2a.bad.graph"))(x)
    for i, good in enumerate(([2.0] * SIZE, tf.fill([SIZE], 2.0),
                              tf.constant([2] * SIZE, tf.int64))):
        out, received = hvd.alltoall(x, splits=good, name=f"a2a.whole.{i}")
        assert received.numpy().tolist() == [2] * SIZE
        assert out.numpy().tolist() == [2.0 * me, 2.0 * me + 1] * SIZE
    out, received = tf.function(lambda t: hvd.alltoall(t, splits=[2.0] * SIZE,
                                                       name="a2a.whole.graph"))(x)
    assert received.numpy().tolist() == [2] * SIZE
    with pytest.raises(ValueError, match="keras.optimizers.Optimizer"):
        hvd_keras.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum,
                                       gradient_predivide_factor=2.0)
    for op in (hvd.Max, hvd.Min, hvd.Product, hvd.Adasum):  # Horovod's Keras refuses them
        with pytest.raises(ValueError, match="^op currently only supports Average and Sum$"):
            hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), op=op)
    for make in (lambda: hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), num_groups=2),
                 lambda: hvd.DistributedGradientTape(tf.GradientTape(), num_groups=2)):
        with pytest.warns(DeprecationWarning, match="`num_groups` has been replaced by `groups`"):
            make()
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(0)
    with pytest.raises(ValueError, match="jit_compile"):
        tf.function(lambda t: hvd.allreduce(t), jit_compile=True)(tf.ones(2))
    with pytest.warns(UserWarning, match="no effect"):
        hvd.allreduce(tf.ones(1), device_dense="/gpu:0", name="warned")
    if SIZE > 1:  # shapes that differ across ranks: an error on every rank, not a hang
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(tf.ones([me + 1]), name="mismatch")
        # inside tf.function the error reaches the caller as TensorFlow's UnknownError
        with pytest.raises(tf.errors.UnknownError, match="Mismatched ALLREDUCE tensor shapes"):
            tf.function(lambda t: hvd.allreduce(t, name="mismatch.graph"))(tf.ones([me + 1]))
    assert hvd.allreduce(tf.ones(2), op=hvd.Sum).numpy().tolist() == [SIZE, SIZE]


# -- last: ops on a subset of ranks shift the unnamed ops' numbering on those ranks -----------
def test_process_set_ops():
    me = hvd.rank()
    if me % 2 == 0:
        # named: unnamed ops are matched by each rank's op count, which odd ranks don't share
        out = hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum, process_set=PS_EVEN,
                            name="ps.ar")
        assert out.numpy()[0] == sum(range(0, SIZE, 2))
        g = hvd.allgather(tf.constant([me]), process_set=PS_EVEN, name="ps.ag")
        np.testing.assert_array_equal(g.numpy(), list(range(0, SIZE, 2)))
    assert int(hvd.join()) in range(SIZE)
