"""Places where a Horovod user compares ringvod with Horovod bit for bit or by exception type;
valid at any world size (the driver runs it at 2 and 3 ranks, in MPI and tcp modes).

* prescale/postscale: Horovod's CPU arithmetic, bit-exact against the reference computed in the
  tensor's own type: float16 scaled in float32 and rounded once, integers through float64 and
  truncated toward zero, float32/float64 in their own type; the prescale before the reduction,
  the postscale after it.
* the gradient of `broadcast` inside a process set;
* `alltoall`'s received splits on the device of `splits`;
* `horovod.common.exceptions.HorovodInternalError` catches a failed collective.
"""
from __future__ import annotations

import pytest
import torch

import horovod.torch as hvd
from tests.parallel._torch_util import PS_EVEN, PS_ODD, SIZE, init_world

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(120)]

SCALE_DTYPES = [torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                torch.int32, torch.int64]
# (prescale, postscale): factors that float16 cannot represent, each side alone and both
FACTORS = [(0.1, 1.0), (1.0, 0.3), (1 / 3, 0.7), (2.5, 1.1)]


@pytest.fixture(scope="module", autouse=True)
def world():
    init_world()
    yield


def values(dtype: torch.dtype, rows: int) -> torch.Tensor:
    """The same tensor on every rank (so the sum is `size` times it): values of up to +-100 with
    fractions for floats, small integers (no overflow after scaling) for integer types."""
    n = rows * 3
    if dtype.is_floating_point:
        x = torch.linspace(-100.0, 100.0, n, dtype=torch.float64) * 1.0137 + 0.003
    elif dtype == torch.uint8:
        x = torch.arange(n, dtype=torch.float64) % 13
    else:
        x = torch.arange(n, dtype=torch.float64) % 25 - 12
    return x.reshape(rows, 3).to(dtype)


def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's CPU scaling of `t` by `factor`, computed in `t`'s type."""
    if factor == 1.0:
        return t
    if t.dtype == torch.float16:
        return (t.float() * torch.tensor(factor, dtype=torch.float32)).half()
    if t.dtype.is_floating_point:
        return t * torch.tensor(factor, dtype=t.dtype)
    return (t.double() * factor).trunc().to(t.dtype)


def expected(x: torch.Tensor, op, pre: float, post: float) -> torch.Tensor:
    if op == hvd.Average:
        post = post / SIZE  # Horovod folds Average's 1/size into the postscale
    return scaled(scaled(x, pre) * SIZE, post)


def share(full: torch.Tensor) -> torch.Tensor:
    base, extra = divmod(full.shape[0], SIZE)
    counts = [base + (1 if r < extra else 0) for r in range(SIZE)]
    start = sum(counts[:hvd.rank()])
    return full[start:start + counts[hvd.rank()]]


def same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: not bit-exact at {bad}: got "
                             f"{[got[tuple(i)].item() for i in bad]}, want "
                             f"{[want[tuple(i)].item() for i in bad]}")


@pytest.mark.parametrize("dtype", SCALE_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("pre,post", FACTORS, ids=lambda f: f"{f:.3g}")
def test_scale_factors_bit_exact(dtype, pre, post):
    key = f"{str(dtype)[6:]}.{pre:.3g}.{post:.3g}"
    for op in (hvd.Sum, hvd.Average):
        rows = 2 * SIZE + 1  # uneven shares for reducescatter
        x, y = values(dtype, rows), values(dtype, rows + SIZE).flip(0).contiguous()
        kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
        tag = f"{key}.{int(op)}"
        same_bits(hvd.allreduce(x, name=f"sc.ar.{tag}", **kw), expected(x, op, pre, post),
                  f"allreduce {tag}")
        z = x.clone()
        hvd.allreduce_(z, name=f"sc.ar_.{tag}", **kw)
        same_bits(z, expected(x, op, pre, post), f"allreduce_ {tag}")
        gx, gy = hvd.grouped_allreduce([x, y], name=f"sc.gar.{tag}", **kw)
        same_bits(gx, expected(x, op, pre, post), f"grouped_allreduce[0] {tag}")
        same_bits(gy, expected(y, op, pre, post), f"grouped_allreduce[1] {tag}")
        same_bits(hvd.reducescatter(x, name=f"sc.rs.{tag}", **kw),
                  share(expected(x, op, pre, post)), f"reducescatter {tag}")
        rx, ry = hvd.grouped_reducescatter([x, y], name=f"sc.grs.{tag}", **kw)
        same_bits(rx, share(expected(x, op, pre, post)), f"grouped_reducescatter[0] {tag}")
        same_bits(ry, share(expected(y, op, pre, post)), f"grouped_reducescatter[1] {tag}")


def test_broadcast_grad_inside_a_process_set():
    # 1 on the set's root (the gradient of sum(), averaged over the set), 0 elsewhere.
    sets = [(hvd.global_process_set, list(range(SIZE)))]
    if SIZE > 1:
        mine = PS_EVEN if hvd.rank() % 2 == 0 else PS_ODD
        sets.append((mine, list(range(hvd.rank() % 2, SIZE, 2))))
    for i, (ps, members) in enumerate(sets):
        root = members[-1]
        x = torch.full((4,), float(hvd.rank()), requires_grad=True)
        y = hvd.broadcast(x, root, name=f"bcgrad.{i}", process_set=ps)
        assert torch.equal(y.detach(), torch.full((4,), float(root)))
        y.sum().backward()
        want = 1.0 if hvd.rank() == root else 0.0
        assert torch.equal(x.grad, torch.full((4,), want)), (i, hvd.rank(), x.grad)


def test_alltoall_received_splits_device_and_dtype():
    splits = torch.tensor([1] * SIZE, dtype=torch.int32)
    x = torch.arange(SIZE, dtype=torch.float32).reshape(SIZE, 1)
    for out, received in (hvd.alltoall(x, splits, name="a2a.dev"),
                          hvd.synchronize(hvd.alltoall_async(x, splits, name="a2a.dev.async")),
                          hvd.alltoall(x, [1] * SIZE, name="a2a.dev.list")):
        assert received.device == splits.device and received.dtype == torch.int32
        assert received.tolist() == [1] * SIZE
        assert out.flatten().tolist() == [float(hvd.rank())] * SIZE


def test_common_exceptions_catch_a_failed_collective():
    from horovod.common.exceptions import HorovodInternalError
    try:
        hvd.allreduce(torch.ones(2 + hvd.rank()), name="parity.bad.shape")
    except HorovodInternalError as exc:
        assert "shape" in str(exc).lower()
    else:
        assert SIZE == 1, "a shape mismatch did not fail"
    # the runtime goes on
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="parity.after").tolist() == [SIZE] * 2
