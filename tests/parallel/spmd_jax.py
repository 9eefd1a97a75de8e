"""Rank-side checks of `horovod.jax`, valid at any world size: every collective and dtype against
NumPy references, scaling, async forms, pytree helpers, training with `DistributedOptimizer`
equal to full-batch training, objects, process sets and error paths (an error on every rank,
not a hang).

`jax_enable_x64` is on here so that int64 and float64 are covered too (the unit tests run
with JAX's default). One file so that JAX is imported once per rank; the file name keeps plain
`pytest` from collecting it. tests/parallel/test_jax.py launches it at np 2 (MPI and tcp), or
directly: `mpirun --allow-run-as-root -np 2 python -m pytest tests/parallel/spmd_jax.py`
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

import horovod.jax as hvd  # noqa: E402
from tests.parallel._util import assert_close, env_size, reference_reduce  # noqa: E402

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(200)]

SIZE = env_size()
PS_EVEN = hvd.ProcessSet(list(range(0, SIZE, 2)))
OPS = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}
DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64", "bool"]


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init(process_sets=[PS_EVEN])
    yield


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode()) % 100000


def data(seed: int, r: int, shape, dtype: str) -> np.ndarray:
    """Rank r's small integer-valued data as NumPy (bfloat16 as float32)."""
    g = np.random.default_rng(seed * 1000 + r)
    if dtype == "bool":
        return g.integers(0, 2, shape).astype(bool)
    lo = 0 if dtype.startswith("u") else -3
    return g.integers(lo, 4, shape).astype(np.float32 if dtype == "bfloat16" else dtype)


def as_jax(a: np.ndarray, dtype: str) -> jax.Array:
    return jnp.asarray(a).astype(dtype)


def check(got: jax.Array, want: np.ndarray, dtype: str, what: str) -> None:
    assert isinstance(got, jax.Array), what
    assert got.dtype == jnp.dtype(dtype), f"{what}: dtype {got.dtype}"
    if dtype == "bfloat16":
        assert got.shape == want.shape, what
        np.testing.assert_allclose(np.asarray(got, np.float32), want.astype(np.float32),
                                   rtol=1e-2, atol=1e-2, err_msg=what)
    else:
        assert_close(np.asarray(got), want.astype(dtype), what)


def test_basics():
    assert hvd.size() == SIZE and 0 <= hvd.rank() < SIZE
    assert hvd.local_rank() == hvd.rank() and hvd.local_size() == SIZE
    assert hvd.process_set_size(PS_EVEN) == len(range(0, SIZE, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_dtype_and_op(dtype):
    me = hvd.rank()
    for key, op in OPS.items():
        if dtype == "bool" and op == hvd.Average:
            continue
        seed = seed_of("ar", dtype, key)
        parts = [data(seed, r, (3, 5), dtype) for r in range(SIZE)]
        want = reference_reduce([p.astype(np.float64) if dtype == "bfloat16" else p
                                 for p in parts], op)
        got = hvd.allreduce(as_jax(parts[me], dtype), op=op, name=f"ar.{dtype}.{key}")
        check(got, want, dtype, f"allreduce {dtype} {key}")
        got = hvd.synchronize(hvd.allreduce_async(as_jax(parts[me], dtype), op=op))
        check(got, want, dtype, f"allreduce_async {dtype} {key}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_broadcast_alltoall_every_dtype(dtype):
    me = hvd.rank()
    seed = seed_of("ag", dtype)
    parts = [data(seed, r, (r + 1, 2), dtype) for r in range(SIZE)]  # uneven dim 0
    check(hvd.allgather(as_jax(parts[me], dtype), name=f"ag.{dtype}"),
          np.concatenate(parts), dtype, f"allgather {dtype}")
    for root in range(SIZE):
        check(hvd.broadcast(as_jax(parts[me][:1], dtype), root, name=f"bc.{dtype}.{root}"),
              parts[root][:1], dtype, f"broadcast {dtype} root {root}")
    # rank r sends r+1 rows... to every rank: splits[i] = i + 1 rows of its own block
    rows = [data(seed + 1, r, (sum(range(1, SIZE + 1)), 2), dtype) for r in range(SIZE)]
    splits = list(range(1, SIZE + 1))
    out, received = hvd.alltoall(as_jax(rows[me], dtype), splits=splits, name=f"a2a.{dtype}")
    offset = sum(range(1, me + 1))
    want = np.concatenate([rows[r][offset:offset + me + 1] for r in range(SIZE)])
    check(out, want, dtype, f"alltoall {dtype}")
    assert received.dtype == jnp.int32 and received.tolist() == [me + 1] * SIZE


def test_scaling_grouped_and_reducescatter():
    me = hvd.rank()
    parts = [data(seed_of("sc"), r, (2 * SIZE + 1, 3), "float32") for r in range(SIZE)]
    x = jnp.asarray(parts[me])
    want = reference_reduce(parts, hvd.Sum, 0.5, 3.0)
    check(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), want,
          "float32", "scaled allreduce")
    a, b = hvd.grouped_allreduce([x, x.astype(jnp.int64)], op=hvd.Sum, name="grouped")
    check(a, reference_reduce(parts, hvd.Sum), "float32", "grouped float32")
    check(b, reference_reduce([p.astype(np.int64) for p in parts], hvd.Sum), "int64",
          "grouped int64")
    total = reference_reduce(parts, hvd.Sum)
    start = sum((2 * SIZE + 1) // SIZE + (1 if r < (2 * SIZE + 1) % SIZE else 0)
                for r in range(me))
    mine = (2 * SIZE + 1) // SIZE + (1 if me < (2 * SIZE + 1) % SIZE else 0)
    check(hvd.reducescatter(x, op=hvd.Sum), total[start:start + mine], "float32",
          "reducescatter sum")
    r1, r2 = hvd.grouped_reducescatter([x, x], op=hvd.Average, name="grs")
    for r in (r1, r2):
        check(r, total[start:start + mine] / SIZE, "float32", "grouped reducescatter avg")
    out = hvd.allreduce(x, compression=hvd.Compression.fp16, name="fp16")
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference_reduce(parts, hvd.Average), atol=1e-2)


def test_pytree_helpers_and_objects():
    me = hvd.rank()
    params = {"w": jnp.full((2, 3), float(me)), "b": jnp.full(3, me, jnp.bfloat16),
              "layers": [jnp.arange(4) + me], "none": None}
    out = hvd.broadcast_variables(params, root_rank=SIZE - 1)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
    for got, sent in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(params)):
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape)
    np.testing.assert_array_equal(out["w"], np.full((2, 3), SIZE - 1.0))
    assert out["b"].dtype == jnp.bfloat16 and float(out["b"][0]) == SIZE - 1
    np.testing.assert_array_equal(out["layers"][0], np.arange(4) + SIZE - 1)
    grads = hvd.allreduce_gradients(params)
    np.testing.assert_allclose(grads["w"], np.full((2, 3), (SIZE - 1) / 2))
    summed = hvd.allreduce_gradients(params, op=hvd.Sum, name="summed")
    assert summed["layers"][0].tolist() == (SIZE * np.arange(4) + sum(range(SIZE))).tolist()
    assert hvd.broadcast_object({"from": me}, root_rank=0) == {"from": 0}
    assert hvd.allgather_object(("rank", me)) == [("rank", r) for r in range(SIZE)]


def test_broadcast_variables_of_a_state_with_static_functions():
    # A training state as flax's TrainState: a dataclass pytree with the apply function as a
    # static field and a jax.tree_util.Partial. The static parts print with each process's
    # memory addresses, which the structure check once compared (an error on every rank).
    import dataclasses
    import functools

    def apply(p, x):
        return x @ p["w"]

    @functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "step"],
                       meta_fields=["apply_fn"])
    @dataclasses.dataclass
    class State:
        params: dict
        step: jax.Array
        apply_fn: object

    me = hvd.rank()
    state = State({"w": jnp.full((2, 2), float(me))}, jnp.asarray(me), apply)
    tree = {"state": state, "fn": jax.tree_util.Partial(apply, {"w": jnp.ones((2, 2)) * me})}
    # random keys too (typed and legacy uint32): they used to be refused as uint32
    tree["rng"] = jax.random.key(me)
    tree["legacy_rng"] = jax.random.PRNGKey(me)
    out = hvd.broadcast_variables(tree, root_rank=0, name="state.bcast")
    assert out["state"].apply_fn is apply and int(out["state"].step) == 0
    assert jax.dtypes.issubdtype(out["rng"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(out["rng"]),
                                  jax.random.key_data(jax.random.key(0)))
    assert out["legacy_rng"].dtype == jnp.uint32
    np.testing.assert_array_equal(out["legacy_rng"], jax.random.PRNGKey(0))
    np.testing.assert_array_equal(out["state"].params["w"], np.zeros((2, 2)))
    np.testing.assert_array_equal(out["fn"].args[0]["w"], np.zeros((2, 2)))


def _loss(params, x, y):
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((pred[:, 0] - y) ** 2)


def test_distributed_optimizer_training_equals_full_batch():
    """Each rank trains on its shard with DistributedOptimizer; the parameters follow the
    full-batch run of the wrapped optimizer exactly (equal shards: mean of means = mean)."""
    optax = pytest.importorskip("optax")
    me = hvd.rank()
    g = np.random.default_rng(5)
    x = g.normal(size=(8 * SIZE, 4))
    y = np.sin(x.sum(1))
    init = {"w1": g.normal(size=(4, 8)) * 0.5, "b1": np.zeros(8), "w2": g.normal(size=(8, 1))}
    mine = {k: jnp.asarray(v + me) for k, v in init.items()}  # ranks start apart
    params = hvd.broadcast_variables(mine, root_rank=0)
    grad_fn = jax.jit(jax.value_and_grad(_loss))
    tx = hvd.DistributedOptimizer(optax.adam(0.05))
    state = tx.init(params)
    ref_tx, ref = optax.adam(0.05), {k: jnp.asarray(v) for k, v in init.items()}
    ref_state = ref_tx.init(ref)
    shard = slice(8 * me, 8 * (me + 1))
    for _ in range(5):
        _, grads = grad_fn(params, x[shard], y[shard])
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        _, rg = grad_fn(ref, x, y)
        rupd, ref_state = ref_tx.update(rg, ref_state, ref)
        ref = optax.apply_updates(ref, rupd)
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-9, atol=1e-9, err_msg=k)


def test_error_paths():
    me = hvd.rank()
    with pytest.raises(ValueError, match="complex64 is not supported"):
        hvd.allreduce(jnp.ones(1, jnp.complex64))
    with pytest.raises(TypeError, match="traced value"):
        jax.jit(lambda v: hvd.allreduce(v))(jnp.ones(2))
    with pytest.raises(ValueError, match="32-bit integer elements"):
        hvd.alltoall(jnp.ones(2 * SIZE), splits=[0.5] * SIZE, name="a2a.bad")
    if SIZE > 1:  # shapes or dtypes that differ across ranks: an error on every rank
        with pytest.raises(hvd.HorovodInternalError, match="Mismatched ALLREDUCE tensor shapes"):
            hvd.allreduce(jnp.ones(me + 1), name="mismatch.shape")
        with pytest.raises(hvd.HorovodInternalError, match="mismatch.dtype"):
            hvd.allreduce(jnp.ones(2, jnp.float32 if me == 0 else jnp.int32),
                          name="mismatch.dtype")
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce_gradients({"w": jnp.ones(me + 1)}, name="mismatch.tree")
        # Gradient trees with different leaf counts (one grouped op of another size per rank):
        # an error on every rank, not a stall.
        grads = {"w": jnp.ones(2), "b": jnp.ones(1)} if me == 0 else {"w": jnp.ones(2)}
        with pytest.raises(hvd.HorovodInternalError, match="Mismatched grouped allreduce sizes"):
            hvd.allreduce_gradients(grads, name="mismatch.leaves")
        # Trees of another structure (a leaf only rank 0 has): an error on every rank, not a
        # broadcast that only some ranks submit.
        tree = {"w": jnp.ones(2), "b": jnp.zeros(1)} if me == 0 else {"w": jnp.ones(2)}
        with pytest.raises(hvd.HorovodInternalError, match="pytrees of different structure"):
            hvd.broadcast_variables(tree, root_rank=0, name="mismatch.structure")
    assert hvd.allreduce(jnp.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]


# -- last: ops on a subset of ranks shift the unnamed ops' numbering on those ranks -----------
def test_process_set_ops():
    me = hvd.rank()
    if me % 2 == 0:
        out = hvd.allreduce(jnp.asarray([float(me)]), op=hvd.Sum, process_set=PS_EVEN,
                            name="ps.ar")
        assert float(out[0]) == sum(range(0, SIZE, 2))
        g = hvd.allgather(jnp.asarray([me]), process_set=PS_EVEN, name="ps.ag")
        assert g.tolist() == list(range(0, SIZE, 2))
    assert int(hvd.join()) in range(SIZE)
