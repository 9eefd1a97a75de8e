"""Single-process tests of the JAX adapter (size 1): every op's values, dtypes and shapes, the
async forms, pytree helpers, the optax optimizer, compression, and the errors (before `init`,
traced values, arrays on an accelerator, unsupported dtypes). The values across ranks are
checked by tests/parallel/spmd_jax.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests._spmd import skip_or_fail

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def jax():
    try:
        import jax
    except ImportError as exc:
        skip_or_fail(f"jax not installed ({exc}): pip install \".[jax]\"", "jax")
    return jax


@pytest.fixture(scope="module")
def hvd(jax):
    import horovod.jax as hvd
    hvd.init()
    yield hvd
    hvd.shutdown()


def test_calls_before_init_raise_the_runtimes_error(jax):
    import collective
    import horovod.jax as hvd
    was = collective.is_initialized()
    if was:
        collective.shutdown()
    x = jax.numpy.ones(3)
    try:
        for call in (lambda: hvd.allreduce(x), lambda: hvd.allreduce_async(x),
                     lambda: hvd.grouped_allreduce([x]), lambda: hvd.allgather(x),
                     lambda: hvd.broadcast(x, 0), lambda: hvd.broadcast_variables({"w": x}),
                     lambda: hvd.allreduce_gradients([x]), lambda: hvd.rank()):
            with pytest.raises(collective.NotInitializedError, match="use hvd.init"):
                call()
    finally:
        if was:
            collective.init()


def test_alias_and_exports(hvd):
    import frameworks.jax
    import horovod.jax
    assert horovod.jax is frameworks.jax is hvd
    for name in hvd.__all__:
        assert getattr(hvd, name) is not None, name
    assert (hvd.size(), hvd.rank(), hvd.local_rank(), hvd.local_size()) == (1, 0, 0, 1)
    assert hvd.is_initialized()


DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "float16", "bfloat16", "float32", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_keeps_dtype_shape_and_values(hvd, jax, dtype):
    jnp = jax.numpy
    x = (jnp.arange(12).reshape(4, 3) % 3).astype(dtype)
    want = np.asarray(x)
    outs = [hvd.allreduce(x, op=hvd.Sum), hvd.broadcast(x, 0), hvd.allgather(x),
            hvd.alltoall(x), hvd.grouped_allreduce([x], op=hvd.Max)[0],
            hvd.grouped_allgather([x])[0], hvd.synchronize(hvd.allreduce_async(x, op=hvd.Min)),
            hvd.synchronize(hvd.broadcast_async(x, 0)), hvd.synchronize(hvd.allgather_async(x))]
    if dtype != "bool":
        outs += [hvd.allreduce(x), hvd.reducescatter(x, op=hvd.Sum),
                 hvd.grouped_reducescatter([x])[0]]
    for out in outs:
        assert isinstance(out, jax.Array)
        assert (out.dtype, out.shape) == (x.dtype, x.shape)
        np.testing.assert_array_equal(np.asarray(out), want)


def test_scaling_and_compression(hvd, jax):
    jnp = jax.numpy
    x = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float32)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                             postscale_factor=0.25), x * 0.5, rtol=1e-6)
    for comp, wire_err in ((hvd.Compression.fp16, 1e-3), (hvd.Compression.bf16, 1e-2)):
        out = hvd.allreduce(x, compression=comp)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, x, atol=wire_err)
        out = hvd.grouped_allreduce([x, jnp.arange(3)], compression=comp)
        assert [o.dtype for o in out] == [jnp.float32, jnp.int32]
    with pytest.raises(TypeError, match="no callable compress"):
        hvd.allreduce(x, compression=object())
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_array_likes_become_jax_arrays(hvd, jax):
    out = hvd.allreduce(np.arange(3, dtype=np.int32), op=hvd.Sum)
    assert isinstance(out, jax.Array) and out.dtype == np.int32
    assert hvd.allreduce(2.5).shape == () and hvd.allreduce([1, 2]).tolist() == [1, 2]
    assert hvd.allgather(jax.numpy.zeros((0, 3))).shape == (0, 3)
    if not jax.config.jax_enable_x64:  # int64 values JAX would wrap to int32: an error
        with pytest.raises(OverflowError, match="jax_enable_x64"):
            hvd.allreduce(np.array([3_000_000_000]), op=hvd.Sum)
        assert hvd.allreduce(np.array([7]), op=hvd.Sum).tolist() == [7]


def test_alltoall_and_reducescatter_forms(hvd, jax):
    x = jax.numpy.arange(6.0).reshape(3, 2)
    out, received = hvd.alltoall(x, splits=[3])
    assert received.dtype == np.int32 and received.tolist() == [3]
    np.testing.assert_array_equal(out, x)
    out, received = hvd.synchronize(hvd.alltoall_async(x, splits=np.array([3])))
    assert received.tolist() == [3]
    h = hvd.grouped_reducescatter_async([x, x[:1]], op=hvd.Sum)
    assert [o.shape for o in hvd.synchronize(h)] == [(3, 2), (1, 2)]
    with pytest.raises(hvd.HorovodInternalError, match="AVERAGE and SUM"):
        hvd.reducescatter(x, op=hvd.Max)
    with pytest.raises(ValueError, match="32-bit integer elements"):
        hvd.alltoall(x, splits=[1.5])


def test_handles(hvd, jax):
    x = jax.numpy.ones(4)
    h = hvd.grouped_allreduce_async([x, 2 * x], name="handles.g")
    assert isinstance(h, hvd.JaxHandle)
    first = hvd.synchronize(h)
    assert hvd.poll(h) and h.done()
    assert hvd.synchronize(h) is first  # waiting again returns the same result
    assert [o.tolist() for o in first] == [[1.0] * 4, [2.0] * 4]
    # a name is free again once its op finished
    h = hvd.allreduce_async(x, name="handles.again")
    h.wait()
    hvd.allreduce(x, name="handles.again")


def test_pytree_helpers(hvd, jax):
    jnp = jax.numpy
    params = {"dense": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)},
              "scale": 2.0, "extra": None, "layers": [jnp.arange(2)]}
    out = hvd.broadcast_variables(params, root_rank=0)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
    assert out["dense"]["b"].dtype == jnp.bfloat16 and out["extra"] is None
    assert isinstance(out["scale"], jax.Array) and float(out["scale"]) == 2.0
    grads = hvd.allreduce_gradients(params)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)
    np.testing.assert_array_equal(grads["dense"]["w"], params["dense"]["w"])
    assert hvd.allreduce_gradients({}) == {} and hvd.broadcast_variables([]) == []
    assert hvd.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert hvd.allgather_object(("x", 1)) == [("x", 1)]


def test_distributed_optimizer_matches_the_wrapped_one(hvd, jax):
    optax = pytest.importorskip("optax")
    jnp = jax.numpy
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    grads = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(1.0)}
    for inner in (optax.adam(0.1), optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))):
        tx = hvd.DistributedOptimizer(inner, gradient_predivide_factor=2.0)
        state = tx.init(params)
        got, _ = tx.update(grads, state, params)
        want, _ = inner.update(grads, inner.init(params), params)
        for k in params:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Adasum)
    with pytest.raises(TypeError, match="GradientTransformation"):
        hvd.DistributedOptimizer(object())
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))
    with pytest.raises(TypeError, match="traced value"):
        jax.jit(tx.update)(grads, tx.init(params))


def test_traced_values_are_refused(hvd, jax):
    x = jax.numpy.ones(3)
    for fn in (lambda v: hvd.allreduce(v), lambda v: hvd.allgather(v),
               lambda v: hvd.allreduce_gradients({"v": v})["v"]):
        with pytest.raises(TypeError, match="traced value .*outside the transformed function"):
            jax.jit(fn)(x)
    with pytest.raises(TypeError, match="traced value"):
        jax.grad(lambda v: hvd.allreduce(v).sum())(x)


def test_accelerator_arrays_are_refused_naming_the_device(hvd, jax):
    class Device:
        platform, id = "gpu", 0

        def __str__(self) -> str:
            return "cuda:0"

    class OnGpu(jax.Array):  # stands in for a GPU array (no GPU JAX on the test machines)
        def __init__(self) -> None:
            pass

        def devices(self) -> set:
            return {Device()}

    for call in (lambda a: hvd.allreduce(a), lambda a: hvd.allreduce_async(a),
                 lambda a: hvd.broadcast(a, 0), lambda a: hvd.allreduce_gradients([a])):
        with pytest.raises(NotImplementedError) as info:
            call(OnGpu())
        msg = str(info.value)
        assert "cuda:0 (gpu)" in msg and "host (CPU)" in msg and "jax.device_put" in msg, msg


def test_unsupported_inputs(hvd, jax):
    jnp = jax.numpy
    with pytest.raises(ValueError, match="complex64 is not supported"):
        hvd.allreduce(jnp.ones(2, jnp.complex64))
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(jnp.float32(1.0))
    with pytest.raises(ValueError, match="Average of a bool tensor"):
        hvd.allreduce(jnp.ones(2, bool))
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(jnp.ones(2), op=hvd.Adasum)
    with pytest.raises(ValueError, match="invalid root rank"):
        hvd.broadcast(jnp.ones(2), 3)


def test_results_wrap_the_engines_buffer_without_a_copy(hvd, jax):
    from frameworks.jax._arrays import aligned_empty, host_view, to_jax
    x = jax.numpy.ones((64, 64))
    view, wire, _ = host_view(x, "allreduce")
    assert wire is None and view.ctypes.data == x.unsafe_buffer_pointer()  # no copy in
    out = aligned_empty((64, 64), view)
    out[...] = 2.0
    assert out.ctypes.data % 64 == 0
    y = to_jax(out, out.dtype)
    assert y.unsafe_buffer_pointer() == out.ctypes.data  # no copy out
    b = to_jax(out.astype(jax.numpy.bfloat16).view(np.uint16), np.dtype(jax.numpy.bfloat16))
    assert b.dtype == jax.numpy.bfloat16 and float(b[0, 0]) == 2.0


def test_ops_return_their_output_without_a_copy(hvd, jax, monkeypatch):
    # Through the public ops: the engines allocate outputs with `aligned_empty`, so each
    # result is wrapped (DLPack), not copied; a copy would skip the wrapper.
    import frameworks.jax._arrays as arrays
    wrapped = []
    real = arrays._from_dlpack

    def counting(a):
        wrapped.append(a.ctypes.data)
        return real(a)
    monkeypatch.setattr(arrays, "_from_dlpack", counting)
    x = jax.numpy.arange(4096, dtype=jax.numpy.float32)
    outs = [hvd.allreduce(x, op=hvd.Sum, name="nocopy.ar"), hvd.allgather(x, name="nocopy.ag"),
            hvd.broadcast(x, 0, name="nocopy.bc")]
    outs += hvd.grouped_allreduce([x, x], op=hvd.Sum, name="nocopy.gar")
    assert len(wrapped) == len(outs)
    for y, ptr in zip(outs, wrapped):
        assert y.unsafe_buffer_pointer() == ptr
        assert np.array_equal(np.asarray(y), np.arange(4096, dtype=np.float32))


def test_reducescatter_refuses_other_ops_as_every_adapter(hvd, jax):
    import collective
    x = jax.numpy.ones(4)
    for fn in (lambda: hvd.reducescatter(x, op=hvd.Max),
               lambda: hvd.grouped_reducescatter_async([x], op=hvd.Min),
               lambda: collective.reducescatter(np.ones(4), op=collective.Max)):
        with pytest.raises(hvd.HorovodInternalError, match="only supports AVERAGE and SUM"):
            fn()


def test_host_inputs_and_results_stay_on_the_first_cpu_device(jax):
    # JAX's default device is a GPU in a CUDA build: a NumPy input (or a bfloat16 result)
    # placed there would be refused as an accelerator array. Here a second CPU device stands
    # in for it as the default: inputs and results are on the first CPU device (DLPack's).
    import os
    import subprocess
    import sys
    code = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "import horovod.jax as hvd\n"
        "hvd.init()\n"
        "c0, c1 = jax.devices('cpu')\n"
        "with jax.default_device(c1):\n"
        "    outs = [hvd.allreduce(np.ones(3, np.float32)), hvd.allreduce([1.0, 2.0]),\n"
        "            hvd.allreduce(np.ones(2, jnp.bfloat16), name='bf'),\n"
        "            hvd.broadcast(jnp.ones(2, jnp.bfloat16, device=c0), 0, name='bc'),\n"
        "            hvd.alltoall(np.arange(4.0, dtype=np.float32))[1]]\n"
        "assert all(o.devices() == {c0} for o in outs), [o.devices() for o in outs]\n"
        "hvd.shutdown()\n"
        "print('ok')\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
