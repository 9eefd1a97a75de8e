"""GPU collectives through the torch adapter and the NCCL engine, at 2 ranks, in MPI and tcp modes.

The driver tests (`test_gpu_spmd_*`) launch this file's `spmd` tests on 2 ranks (one GPU each);
the rank side checks every op and dtype against a float64 CPU reference built from every rank's
(deterministic) input, stream ordering (a producer on a side stream, a consumer on another),
mixed CPU/GPU work, training equality with `DistributedOptimizer` (plain, fp16 and bf16
compression), `SyncBatchNorm`, CuPy arrays through `collective.adapter.enqueue`, and error paths.
Skipped without CUDA (or with fewer than 2 GPUs) unless RINGVOD_TEST_REQUIRE names gpu.
"""
from __future__ import annotations

import copy
import os
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402

from tests._spmd import (_LAUNCHERS, _tcp_command, in_spmd_rank, mpi_available,  # noqa: E402
                         register_launcher, run_spmd, skip_or_fail)

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
HERE = os.path.dirname(os.path.abspath(__file__))


def _tcp_launcher(np_: int, child: list[str], env: dict) -> tuple[list[str], dict]:
    # hvdrun --tcp: the launcher's own local spawning (kills the job when a rank fails).
    return [sys.executable, "-m", "launcher", "-np", str(np_), "--tcp", *child], env


if _LAUNCHERS.get("tcp") is _tcp_command:
    register_launcher("tcp", _tcp_launcher)


def need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        skip_or_fail(f"needs {n} CUDA GPUs (found "
                     f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})", "gpu")


def launch(target: str, mode: str, timeout: float = 240, env: dict | None = None, **kw):
    need_gpus(2)
    if mode == "mpi":
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    return run_spmd(target, 2, timeout, mode=mode, env={**GPU_ENV, **(env or {})}, **kw)


# -- drivers --------------------------------------------------------------------------------------
@pytest.mark.spmd_driver
@pytest.mark.timeout(210)
@pytest.mark.parametrize("mode", ["mpi", "tcp"])
def test_gpu_spmd(mode: str) -> None:
    # Every rank-side test runs even after a failure (they fail alike on every rank).
    launch(__file__, mode, timeout=180, args=["--maxfail=1000"])


@pytest.mark.spmd_driver
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["mpi", "tcp"])
def test_gpu_per_gradient_mode(mode: str) -> None:
    # Horovod's per-gradient mode (no buckets): the optimizer's gradient set on the GPU.
    launch(__file__, mode, timeout=120, env={"HOROVOD_BUCKET_CAP_MB": "0"},
           args=["--maxfail=1000", "-k", "training_equality or joins or reinit or batch_norm"])


@pytest.mark.spmd_driver
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["mpi", "tcp"])
@pytest.mark.parametrize("what", ["allreduce", "train", "train-per-gradient"])
def test_gpu_killed_peer_ends_job(mode: str, what: str) -> None:
    # "train": DistributedOptimizer steps, whose bucket allreduces (or, per gradient, gradient
    # set ops) wait on the GPU for the dead peer; the job must end all the same.
    pg = what == "train-per-gradient"
    res = launch(os.path.join(HERE, "_killed_peer.py"), mode, timeout=120, check=False,
                 args=["train" if pg else what],
                 env={"HOROVOD_BUCKET_CAP_MB": "0"} if pg else None)
    assert not res.timed_out, "a killed peer left the job hanging:\n" + res.report()
    assert res.returncode != 0, res.report()
    assert res.duration < 90, res.report()


@pytest.mark.spmd_driver
@pytest.mark.timeout(150)
def test_gpu_comm_init_timeout() -> None:
    res = launch(os.path.join(HERE, "_init_timeout.py"), "mpi", timeout=120, check=False)
    # The ranks leave with os._exit (an NCCL init thread is still stuck), so mpirun may call
    # the exit improper; what matters is that nobody hung and both ranks got the message.
    assert not res.timed_out, res.report()
    for r in res.ranks:
        assert "did not complete within" in r.log, res.report()


# -- rank side ------------------------------------------------------------------------------------
DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


@pytest.fixture(scope="module")
def hvd():
    if not in_spmd_rank():
        pytest.skip("rank side")
    import frameworks.torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    yield hvd
    hvd.shutdown()


def make(rank: int, shape: tuple, dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 31 * salt + 7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo = 0 if dtype == torch.uint8 else -2
    return torch.randint(lo, 3, shape, generator=g).to(dtype)


def reference(xs: list[torch.Tensor], op, n: int, pre: float = 1.0, post: float = 1.0,
              hvd=None) -> torch.Tensor:
    dtype = xs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(xs)
        return stack.any(0) if op in (hvd.Sum, hvd.Max) else stack.all(0)
    f = torch.stack([x.double() * pre for x in xs])
    if not dtype.is_floating_point and pre != 1.0:
        f = f.trunc()
    if op in (hvd.Sum, hvd.Average):
        r = f.sum(0)
    elif op == hvd.Product:
        r = f.prod(0)
    elif op == hvd.Max:
        r = f.amax(0)
    else:
        r = f.amin(0)
    r = r * post / (n if op == hvd.Average else 1)
    return (r if dtype.is_floating_point else r.trunc()).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    if want.dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    elif want.dtype.is_floating_point:
        torch.testing.assert_close(got, want)
    else:
        assert torch.equal(got, want), (got, want)


@pytest.mark.spmd
def test_allreduce_every_dtype_and_op(hvd) -> None:
    r, n = hvd.rank(), hvd.size()
    for dt in DTYPES:
        for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Average):
            if dt == torch.bool and op == hvd.Average:
                continue
            x = make(r, (33, 5), dt, int(op)).cuda()
            got = hvd.synchronize(hvd.allreduce_async(x, op=op, name=f"ar.{dt}.{op}"))
            same(got, reference([make(q, (33, 5), dt, int(op)) for q in range(n)], op, n,
                                hvd=hvd))
            assert torch.equal(x.cpu(), make(r, (33, 5), dt, int(op)))  # input unchanged


@pytest.mark.spmd
def test_allreduce_inplace_fused_scaled(hvd) -> None:
    r, n = hvd.rank(), hvd.size()
    shapes = [(1,), (1000,), (3, 7), (0,), (64, 64), (5, 1, 3), (2 ** 20 + 3,)]
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.float64):
        xs = [make(r, s, dt, i).cuda() for i, s in enumerate(shapes)]
        hvd.grouped_allreduce_(xs, op=hvd.Average, prescale_factor=0.5, postscale_factor=4.0,
                               name=f"grp.{dt}")
        for i, s in enumerate(shapes):
            same(xs[i], reference([make(q, s, dt, i) for q in range(n)], hvd.Average, n, 0.5,
                                  4.0, hvd))
        # Out of place, members of 1 MiB and more reduced by NCCL calls of their own in the
        # fused op's group (the engine's DIRECT_BYTES), the others through the fusion buffer.
        zs = [make(r, s, dt, 20 + i).cuda() for i, s in enumerate(shapes + [(2 ** 19 + 1,)])]
        outs = hvd.grouped_allreduce(zs, op=hvd.Average, prescale_factor=0.5,
                                     postscale_factor=4.0, name=f"grp.out.{dt}")
        for i, z in enumerate(zs):
            s = tuple(z.shape)
            same(outs[i], reference([make(q, s, dt, 20 + i) for q in range(n)], hvd.Average, n,
                                    0.5, 4.0, hvd))
            assert torch.equal(z.cpu(), make(r, s, dt, 20 + i))  # input unchanged
        # Many separate in-place allreduces submitted together fuse in the coordinator.
        ys = [make(r, s, dt, 10 + i).cuda() for i, s in enumerate(shapes)]
        hs = [hvd.allreduce_async_(y, op=hvd.Sum, name=f"sep.{dt}.{i}") for i, y in enumerate(ys)]
        for h in hs:
            hvd.synchronize(h)
        for i, s in enumerate(shapes):
            same(ys[i], reference([make(q, s, dt, 10 + i) for q in range(n)], hvd.Sum, n,
                                  hvd=hvd))


@pytest.mark.spmd
def test_fused_members_sharing_memory_while_a_rank_joins(hvd) -> None:
    # The last rank joined: its zeros for a fused op are separate buffers, so its members of
    # 1 MiB or more get NCCL calls of their own. The others pass one such tensor twice
    # (members sharing memory go through the fusion buffer) and must make the same NCCL
    # calls (one per large member, one for the rest), or the ranks' NCCL calls differ: a hang.
    r, n = hvd.rank(), hvd.size()
    if r == n - 1:
        hvd.join()
        return
    x = make(r, (2 ** 18 + 5,), torch.float32, 30).cuda()
    small = make(r, (7,), torch.float32, 31).cuda()
    hvd.grouped_allreduce_([x, small, x], op=hvd.Sum, name="shared.join")
    for got, s, salt in ((x, (2 ** 18 + 5,), 30), (small, (7,), 31)):
        parts = [make(q, s, torch.float32, salt) for q in range(n - 1)]
        same(got, reference(parts + [torch.zeros(s)], hvd.Sum, n, hvd=hvd))
    hvd.join()


@pytest.mark.spmd
def test_allgather_uneven_and_grouped(hvd) -> None:
    r, n = hvd.rank(), hvd.size()
    for dt in DTYPES:
        x = make(r, (r + 1, 3), dt).cuda()
        got = hvd.synchronize(hvd.allgather_async(x, name=f"ag.{dt}"))
        same(got, torch.cat([make(q, (q + 1, 3), dt) for q in range(n)]))
    rows = lambda q, t: (q + t) % 3  # noqa: E731 - includes empty shares
    xs = [make(r, (rows(r, t), t + 1, 2), torch.float32, t).cuda() for t in range(5)]
    outs = hvd.synchronize(hvd.grouped_allgather_async(xs, name="ag.grouped"))
    for t in range(5):
        same(outs[t], torch.cat([make(q, (rows(q, t), t + 1, 2), torch.float32, t)
                                 for q in range(n)]))
    g = hvd.allgather(make(r, (2, 2), torch.float32).cuda(), name="ag.autograd")
    same(g, torch.cat([make(q, (2, 2), torch.float32) for q in range(n)]))


@pytest.mark.spmd
def test_broadcast_and_helpers(hvd) -> None:
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        for dt in (torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.int64):
            x = make(r, (9, 4), dt, root).cuda()
            same(hvd.synchronize(hvd.broadcast_async(x, root, name=f"bc.{root}.{dt}")),
                 make(root, (9, 4), dt, root))
            hvd.broadcast_(x, root, name=f"bc_.{root}.{dt}")
            same(x, make(root, (9, 4), dt, root))
    model = torch.nn.Linear(5, 3).cuda()
    torch.nn.init.constant_(model.weight, float(r))
    hvd.broadcast_parameters(model.state_dict(), root_rank=1 % n)
    assert torch.all(model.weight == float(1 % n))
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    # A tensor option (a capturable Adam's lr on the GPU) arrives on this rank's GPU, not on
    # the root's device index (every rank here sees every GPU).
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01 * (r + 1), device="cuda"),
                           capturable=True)
    model(torch.ones(2, 5, device="cuda")).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    lr = opt.param_groups[0]["lr"]
    assert lr.device == model.weight.device and abs(float(lr) - 0.01) < 1e-7, lr
    opt.step()


@pytest.mark.spmd
def test_alltoall_splits(hvd) -> None:
    r, n = hvd.rank(), hvd.size()
    splits = lambda q: [(q + d) % 3 for d in range(n)]  # noqa: E731
    for dt in (torch.float32, torch.int8, torch.bfloat16):
        x = make(r, (sum(splits(r)) + 1, 3), dt).cuda()
        out, recv = hvd.synchronize(hvd.alltoall_async(x, torch.tensor(splits(r),
                                                                       dtype=torch.int32),
                                                       name=f"a2a.{dt}"))
        assert recv.tolist() == [splits(q)[r] for q in range(n)]
        parts = []
        for q in range(n):
            xq = make(q, (sum(splits(q)) + 1, 3), dt)
            start = sum(splits(q)[:r])
            parts.append(xq[start:start + splits(q)[r]])
        same(out, torch.cat(parts))
    even = make(r, (2 * n, 2), torch.float32).cuda()
    out = hvd.alltoall(even, name="a2a.even")
    same(out, torch.cat([make(q, (2 * n, 2), torch.float32)[2 * r:2 * r + 2] for q in range(n)]))


@pytest.mark.spmd
def test_reducescatter_even_uneven(hvd) -> None:
    r, n = hvd.rank(), hvd.size()

    def share(full: torch.Tensor) -> torch.Tensor:
        base, extra = divmod(full.shape[0], n)
        counts = [base + (1 if q < extra else 0) for q in range(n)]
        start = sum(counts[:r])
        return full[start:start + counts[r]]

    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.float16):
        for dim0 in (2 * n, 2 * n + 1, 1):
            for op in (hvd.Sum, hvd.Average):
                x = make(r, (dim0, 3), dt, dim0).cuda()
                got = hvd.synchronize(hvd.reducescatter_async(x, op=op,
                                                              name=f"rs.{dt}.{dim0}.{op}"))
                same(got, share(reference([make(q, (dim0, 3), dt, dim0) for q in range(n)],
                                          op, n, hvd=hvd)))
    xs = [make(r, (d, 2), torch.float32, d).cuda() for d in (n, n + 1, 3 * n - 1)]
    outs = hvd.synchronize(hvd.grouped_reducescatter_async(xs, op=hvd.Sum, name="rs.grouped"))
    for i, d in enumerate((n, n + 1, 3 * n - 1)):
        same(outs[i], share(reference([make(q, (d, 2), torch.float32, d) for q in range(n)],
                                      hvd.Sum, n, hvd=hvd)))


@pytest.mark.spmd
def test_stream_ordering(hvd) -> None:
    """Fails if the ready event or the completion wait is missing: the producer writes on a
    side stream behind a long sleep just before enqueue; the consumer reads on another stream
    right after synchronize."""
    r, n = hvd.rank(), hvd.size()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for it in range(4):
        with torch.cuda.stream(s1):
            x = torch.empty(1 << 22, device="cuda")
            torch.cuda._sleep(20_000_000)
            x.fill_(float(r + 1 + it))
            h = hvd.allreduce_async(x, op=hvd.Sum, name=f"order.{it}")
            y_ = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(20_000_000)
            y_.fill_(float(r + it))
            h2 = hvd.allreduce_async_(y_, op=hvd.Sum, name=f"order_.{it}")
        with torch.cuda.stream(s2):
            y = hvd.synchronize(h)
            total = (y * 1.0).sum()
            hvd.synchronize(h2)
            total2 = (y_ * 1.0).sum()
        s2.synchronize()
        want = sum(q + 1 + it for q in range(n)) * float(1 << 22)
        assert total.item() == want, (it, total.item(), want)
        assert total2.item() == sum(q + it for q in range(n)) * float(1 << 20)
        s1.synchronize()


@pytest.mark.spmd
def test_synchronous_ops_on_the_callers_stream(hvd) -> None:
    """Synchronous ops that take the express lane run on the caller's stream: each is ordered
    after the caller's earlier work there (a long sleep before the write), before its later
    work, and against async ops on the engine's stream launched from another stream just
    before and after; on the default stream (handle 0) and on a side stream; in place, with
    a new output, and a broadcast."""
    from collective import _current

    r, n = hvd.rank(), hvd.size()
    side = torch.cuda.Stream()
    total = float(sum(q + 1 for q in range(n)))
    for it in range(6):
        for stream in (torch.cuda.default_stream(), side):
            other = torch.cuda.Stream()
            with torch.cuda.stream(other):
                a = torch.full((1 << 18,), float(r + it), device="cuda")
                ha = hvd.allreduce_async_(a, op=hvd.Sum, name="caller.before")
            with torch.cuda.stream(stream):
                x = torch.empty(1 << 20, device="cuda")
                torch.cuda._sleep(10_000_000)
                x.fill_(float(r + 1))
                hvd.allreduce_(x, op=hvd.Sum, name="caller.inplace")
                got = x.sum()
                torch.cuda._sleep(5_000_000)
                z = torch.full((1 << 16,), float(r + 2), device="cuda")
                out = hvd.allreduce(z, op=hvd.Sum, name="caller.out")
                got_out = out.sum()
                b = torch.full((1 << 16,), float(r + it), device="cuda")
                hvd.broadcast_(b, root_rank=n - 1, name="caller.bcast")
                got_b = b.sum()
            with torch.cuda.stream(other):
                c = torch.full((1 << 18,), float(r), device="cuda")
                hc = hvd.allreduce_async_(c, op=hvd.Sum, name="caller.after")
                hvd.synchronize(ha)
                hvd.synchronize(hc)
                got_a, got_c = a.sum(), c.sum()
            stream.synchronize()
            other.synchronize()
            assert got.item() == total * (1 << 20), (it, got.item())
            assert got_out.item() == float(sum(q + 2 for q in range(n))) * (1 << 16)
            assert got_b.item() == float(n - 1 + it) * (1 << 16)
            assert got_a.item() == float(sum(q + it for q in range(n))) * (1 << 18)
            assert got_c.item() == float(sum(range(n))) * (1 << 18)
    eng = _current.current().member_sets()[0].device_engine
    assert eng._caller_done is not None, "no synchronous op ran on its caller's stream"


@pytest.mark.spmd
def test_large_async_ops_start_at_once_in_any_order(hvd) -> None:
    """Async allreduces of `collective.ops.EAGER_BYTES` or more are negotiated and launched by
    the call itself (the express lane on the caller's thread); started in opposite orders on
    the two ranks they fall back to ordinary rounds. Every result is right, nothing hangs."""
    from collective import _current
    from collective.ops import EAGER_BYTES

    r, n = hvd.rank(), hvd.size()
    coord = _current.current().coordinator
    numel = EAGER_BYTES // 4 + 3
    xs = [torch.empty(numel, device="cuda") for _ in range(4)]
    before = coord.express_rounds
    for it in range(8):
        order = list(range(4)) if it < 5 or r % 2 == 0 else [3, 2, 1, 0]
        for i in order:
            xs[i].fill_(float(r + i + it))
        hs = {i: hvd.allreduce_async_(xs[i], op=hvd.Sum, name=f"eager.{i}") for i in order}
        for i in range(4):
            hvd.synchronize(hs[i])
            want = float(sum(q + i + it for q in range(n)))
            assert torch.all(xs[i] == want).item(), (it, i, xs[i][:3], want)
    assert coord.express_rounds > before, "no large async op ran on the caller's thread"


@pytest.mark.spmd
def test_mixed_cpu_and_gpu(hvd) -> None:
    r, n = hvd.rank(), hvd.size()
    hs = []
    for i in range(6):
        dev = "cuda" if i % 2 else "cpu"
        hs.append((dev, hvd.allreduce_async(torch.full((100,), float(r), device=dev),
                                            op=hvd.Sum, name=f"mixed.{i}")))
    for dev, h in hs:
        out = hvd.synchronize(h)
        assert out.device.type == dev
        assert torch.all(out.cpu() == float(sum(range(n))))


@pytest.mark.spmd
def test_cupy_arrays_through_enqueue(hvd) -> None:
    cupy = pytest.importorskip("cupy")
    import collective
    from collective import DataType, RequestType
    r, n = hvd.rank(), hvd.size()
    with cupy.cuda.Device(torch.cuda.current_device()):
        a = cupy.full((257,), float(r + 1), dtype=cupy.float32)
        ev = cupy.cuda.Event()
        ev.record()
        h = collective.adapter.enqueue(RequestType.ALLREDUCE, [a], device=a.device.id,
                               dtypes=[DataType.FLOAT32], shapes=[a.shape], ready_events=[ev],
                               op=collective.Sum, name="cupy.ar")
        res = h.wait()
        res.wait(cupy.cuda.get_current_stream().ptr)
        assert float(res.output.sum()) == 257.0 * sum(q + 1 for q in range(n))


def _train(hvd, compression, steps: int = 6, sync_bn: bool = False, out: dict | None = None):
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    bn = hvd.SyncBatchNorm(6) if sync_bn else torch.nn.Identity()
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), bn, torch.nn.ReLU(),
                                torch.nn.Linear(6, 4)).cuda()
    ref = copy.deepcopy(model)
    if sync_bn:
        ref[1] = torch.nn.BatchNorm1d(6).cuda()
        ref[1].load_state_dict(model[1].state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    per = 4
    for step in range(steps):
        x = torch.randn(n * per, 8, generator=g).cuda()
        y = torch.randn(n * per, 4, generator=g).cuda()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[r * per:(r + 1) * per]),
                                            y[r * per:(r + 1) * per])
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    if out is not None:
        out["opt"] = opt
    return model, ref


def _small(hvd):
    """A small MLP on the GPU and a plain-SGD DistributedOptimizer over it (one bucket)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(),
                                torch.nn.Linear(6, 4)).cuda()
    return model, _sgd(hvd, model)


def _sgd(hvd, model):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters())


def _backward(hvd, model, opt, seed: int) -> None:
    """zero_grad and backward on this rank's own batch (the batch depends on the rank)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=g).cuda(), torch.randn(4, 4, generator=g).cuda()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x + hvd.rank()), y).backward()


def _same_on_every_rank(hvd, model, name: str) -> None:
    for p in model.parameters():
        gathered = hvd.allgather(p.detach().reshape(1, -1), name=name)
        assert torch.equal(gathered[0], gathered[-1])


@pytest.mark.spmd
def test_training_equality(hvd) -> None:
    for comp, tol in ((hvd.Compression.none, 1e-4), (hvd.Compression.fp16, 2e-3),
                      (hvd.Compression.bf16, 2e-2)):
        out: dict = {}
        model, ref = _train(hvd, comp, out=out)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=f"{comp.__name__} {name}")
        _same_on_every_rank(hvd, model, "eq.check")  # every rank holds identical parameters


@pytest.mark.spmd
def test_optimizer_steps_while_a_rank_joins(hvd) -> None:
    # Rank 1 runs out of data after 2 steps and joins while rank 0 takes 2 more: rank 0's
    # buckets of steps 3 and 4 are reduced with join's zeros from rank 1 (rank 0's gradient
    # averaged with zeros), and a step after the join works again.
    r, n = hvd.rank(), hvd.size()
    model, opt = _small(hvd)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    per = 4
    data = [(torch.randn(n * per, 8, generator=g).cuda(), torch.randn(n * per, 4, generator=g
                                                                      ).cuda())
            for _ in range(4)]
    my_steps = 4 if r == 0 else 2
    for step, (x, y) in enumerate(data[:my_steps]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[r * per:(r + 1) * per]),
                                     y[r * per:(r + 1) * per]).backward()
        opt.step()
        ref_opt.zero_grad()
        if step < 2:  # both ranks: the full batch's mean
            torch.nn.functional.mse_loss(ref(x), y).backward()
        else:  # rank 1 joined: rank 0's gradient plus zeros, averaged over both ranks
            (torch.nn.functional.mse_loss(ref(x[:per]), y[:per]) / n).backward()
        ref_opt.step()
    hvd.join()
    if r == 0:
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    # Rank 1 stopped updating at its join: start the next epoch from rank 0's parameters,
    # then a step together must keep them identical.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _backward(hvd, model, opt, 4)
    opt.step()
    _same_on_every_rank(hvd, model, "join.check")


@pytest.mark.spmd
def test_optimizer_after_reinit_and_second_optimizer(hvd) -> None:
    # As in an elastic reset: the runtime is shut down and started again; rank 0 keeps its
    # optimizer, rank 1 builds a new one over the same model (a new worker's). A second
    # optimizer over a same-named model is never refused.
    import gc
    model, opt = _small(hvd)
    for i in range(3):
        _backward(hvd, model, opt, i)
        opt.step()
    hvd.shutdown()
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if hvd.rank() == 1:
        del opt
        gc.collect()  # the old optimizer's hooks must not fire any more
        opt = _sgd(hvd, model)
    for i in range(3, 6):
        _backward(hvd, model, opt, i)
        opt.step()
    _same_on_every_rank(hvd, model, "reinit.check")


@pytest.mark.spmd
def test_sync_batch_norm_matches_full_batch(hvd) -> None:
    model, ref = _train(hvd, hvd.Compression.none, steps=4, sync_bn=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var, rtol=1e-4, atol=1e-4)


@pytest.mark.spmd
def test_error_paths(hvd) -> None:
    r, n = hvd.rank(), hvd.size()
    with pytest.raises(hvd.HorovodInternalError, match="(?i)shape"):
        hvd.synchronize(hvd.allreduce_async(torch.ones(3 + r, device="cuda"), name="bad.shape"))
    with pytest.raises(hvd.HorovodInternalError, match="CPU/GPU"):
        hvd.synchronize(hvd.allreduce_async(torch.ones(3, device="cuda" if r else "cpu"),
                                            name="bad.device"))
    with pytest.raises(ValueError, match="int16"):
        hvd.synchronize(hvd.allreduce_async(torch.ones(4, dtype=torch.int16, device="cuda"),
                                            op=hvd.Sum, name="bad.int16"))
    # The runtime and the communicator still work afterwards.
    out = hvd.synchronize(hvd.allreduce_async(torch.ones(5, device="cuda"), op=hvd.Sum,
                                              name="after.errors"))
    assert torch.all(out.cpu() == n)
    gathered = hvd.synchronize(hvd.allgather_async(torch.ones((1, 2), dtype=torch.int16,
                                                              device="cuda") * r,
                                                   name="int16.gather"))
    assert gathered[:, 0].tolist() == list(range(n))
