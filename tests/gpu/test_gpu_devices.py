"""GPU ops on a tensor's own device when that device is not the current one, at 2 ranks, in MPI
and tcp modes; and Horovod's GPU arithmetic and error types.

The ranks never call `torch.cuda.set_device`: rank r places its tensors with
`t.cuda(hvd.local_rank())`, so rank 1 works on cuda:1 while its current device stays cuda:0,
as many Horovod scripts do. Every place that touches a device is covered: ops and grouped ops,
completion events ordering the caller's stream, the optimizer's gradient buckets,
`broadcast_parameters`/`broadcast_optimizer_state`, `SyncBatchNorm`, the timeline (written by
the driver's run and read back), scale factors bit-exact in half precision, `alltoall`'s
received splits on the device of `splits`, the gradient of `broadcast` in a process set, error
types, and one process using a second device (a clear error naming both, never a CUDA error).
Skipped without 2 CUDA GPUs unless RINGVOD_TEST_REQUIRE names gpu.
"""
from __future__ import annotations

import copy
import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402

from tests._spmd import in_spmd_rank, mpi_available, run_spmd, skip_or_fail  # noqa: E402
from tests.gpu.test_gpu_ops import GPU_ENV, make, need_gpus, reference, same  # noqa: E402

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]


# -- driver ---------------------------------------------------------------------------------------
@pytest.mark.spmd_driver
@pytest.mark.timeout(270)
@pytest.mark.parametrize("mode", ["mpi", "tcp"])
def test_gpu_devices_spmd(mode: str, tmp_path) -> None:
    need_gpus(2)
    if mode == "mpi":
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    timeline = str(tmp_path / "timeline.json")
    run_spmd(__file__, 2, 240, mode=mode, env=dict(GPU_ENV, HOROVOD_TIMELINE=timeline),
             args=["--maxfail=1000"])
    with open(timeline) as f:  # rank 0's timeline: the NCCL activities of tensors on cuda:1
        text = f.read()
    assert "NCCL_ALLREDUCE" in text and "dev.tl" in text, text[-2000:]


# -- rank side ------------------------------------------------------------------------------------
SETS: list = []

@pytest.fixture(scope="module")
def hvd():
    if not in_spmd_rank():
        pytest.skip("rank side")
    import frameworks.torch as hvd
    SETS[:] = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]  # one-rank sets, by rank
    hvd.init(process_sets=SETS)
    yield hvd
    hvd.shutdown()


def dev_of(hvd) -> torch.device:
    return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())


def on(hvd, t: torch.Tensor) -> torch.Tensor:
    return t.cuda(hvd.local_rank())


@pytest.mark.spmd
def test_current_device_is_left_alone(hvd) -> None:
    assert torch.cuda.current_device() == 0  # rank 1 works on cuda:1 without set_device
    assert hvd.size() == 2


@pytest.mark.spmd
def test_ops_on_the_tensors_device(hvd) -> None:
    r, n, dev = hvd.rank(), hvd.size(), dev_of(hvd)
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8):
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            if op == hvd.Average and not dt.is_floating_point:
                continue
            x = on(hvd, make(r, (33, 5), dt, int(op)))
            got = hvd.allreduce(x, op=op, name=f"dev.ar.{dt}.{op}")
            assert got.device == dev
            same(got, reference([make(q, (33, 5), dt, int(op)) for q in range(n)], op, n,
                                hvd=hvd))
        y = on(hvd, make(r, (7, 2), dt))
        hvd.allreduce_(y, op=hvd.Sum, name=f"dev.ar_.{dt}")
        same(y, reference([make(q, (7, 2), dt) for q in range(n)], hvd.Sum, n, hvd=hvd))
        g = hvd.synchronize(hvd.allgather_async(on(hvd, make(r, (r + 1, 3), dt)),
                                                name=f"dev.ag.{dt}"))
        assert g.device == dev
        same(g, torch.cat([make(q, (q + 1, 3), dt) for q in range(n)]))
        b = on(hvd, make(r, (4, 4), dt))
        hvd.broadcast_(b, 1, name=f"dev.bc.{dt}")
        same(b, make(1, (4, 4), dt))
    rs = hvd.reducescatter(on(hvd, make(r, (2 * n + 1, 3), torch.float32)), op=hvd.Sum,
                           name="dev.rs")
    full = reference([make(q, (2 * n + 1, 3), torch.float32) for q in range(n)], hvd.Sum, n,
                     hvd=hvd)
    same(rs, full[:3] if r == 0 else full[3:])  # 5 rows at 2 ranks: 3 and 2
    # grouped ops
    xs = [on(hvd, make(r, s, torch.float32, i)) for i, s in enumerate([(3,), (5, 2), (0,)])]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="dev.gar")
    for i, s in enumerate([(3,), (5, 2), (0,)]):
        assert outs[i].device == dev
        same(outs[i], reference([make(q, s, torch.float32, i) for q in range(n)], hvd.Sum, n,
                                hvd=hvd))
    hvd.grouped_allreduce_(xs, op=hvd.Sum, name="dev.gar_")
    gs = hvd.grouped_allgather([on(hvd, make(r, (r + 1, 2), torch.float32, t)) for t in range(3)],
                               name="dev.gag")
    for t in range(3):
        same(gs[t], torch.cat([make(q, (q + 1, 2), torch.float32, t) for q in range(n)]))
    grs = hvd.grouped_reducescatter([on(hvd, make(r, (2 * n, 2), torch.float32, t))
                                     for t in range(2)], op=hvd.Sum, name="dev.grs")
    for t in range(2):
        full = reference([make(q, (2 * n, 2), torch.float32, t) for q in range(n)], hvd.Sum, n,
                         hvd=hvd)
        same(grs[t], full[2 * r:2 * r + 2])
    tl = hvd.allreduce(on(hvd, torch.ones(4)), op=hvd.Sum, name="dev.tl")  # in the timeline
    assert tl.cpu().tolist() == [float(n)] * 4
    assert torch.cuda.current_device() == 0


@pytest.mark.spmd
def test_completion_orders_the_tensors_streams(hvd) -> None:
    """Fails if the ready event is recorded on, or the completion waited for by, the current
    device's stream instead of the tensor's: the producer writes behind a long sleep on the
    tensor device's default stream, the consumer reads right after synchronize; then the same
    on side streams of the tensor's device."""
    r, n, dev = hvd.rank(), hvd.size(), dev_of(hvd)
    for it in range(3):
        x = torch.empty(1 << 22, device=dev)
        with torch.cuda.device(dev):  # only the sleep: the op is enqueued outside
            torch.cuda._sleep(20_000_000)
        x.fill_(float(r + 1 + it))
        h = hvd.allreduce_async(x, op=hvd.Sum, name=f"dev.order.{it}")
        assert torch.cuda.current_device() == 0
        y = hvd.synchronize(h)
        total = (y * 1.0).sum()
        assert total.item() == sum(q + 1 + it for q in range(n)) * float(1 << 22), it
    s1, s2 = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
    for it in range(3):
        with torch.cuda.stream(s1):
            x = torch.empty(1 << 22, device=dev)
            torch.cuda._sleep(20_000_000)
            x.fill_(float(r + it))
            h = hvd.allreduce_async_(x, op=hvd.Sum, name=f"dev.order_.{it}")
        with torch.cuda.stream(s2):
            hvd.synchronize(h)
            total = (x * 1.0).sum()
        s2.synchronize()
        assert total.item() == sum(q + it for q in range(n)) * float(1 << 22), it
        s1.synchronize()
    assert torch.cuda.current_device() == 0


def _train(hvd, steps: int = 5, sync_bn: bool = False, groups=None):
    r, n, dev = hvd.rank(), hvd.size(), dev_of(hvd)
    torch.manual_seed(0)
    bn = hvd.SyncBatchNorm(6) if sync_bn else torch.nn.Identity()
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), bn, torch.nn.ReLU(),
                                torch.nn.Linear(6, 4)).cuda(hvd.local_rank())
    ref = copy.deepcopy(model)
    if sync_bn:
        ref[1] = torch.nn.BatchNorm1d(6).to(dev)
        ref[1].load_state_dict(model[1].state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), groups=groups)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    per = 4
    for _ in range(steps):
        x = torch.randn(n * per, 8, generator=g).to(dev)
        y = torch.randn(n * per, 4, generator=g).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[r * per:(r + 1) * per]),
                                     y[r * per:(r + 1) * per]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    return model, ref


@pytest.mark.spmd
def test_optimizer_buckets_and_groups(hvd) -> None:
    for groups in (None, 2):  # gradient buckets (the default), grouped allreduces
        model, ref = _train(hvd, groups=groups)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=f"{groups} {name}")
    assert torch.cuda.current_device() == 0


@pytest.mark.spmd
def test_sync_batch_norm(hvd) -> None:
    model, ref = _train(hvd, steps=3, sync_bn=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var, rtol=1e-4, atol=1e-4)


@pytest.mark.spmd
def test_broadcast_parameters_and_optimizer_state(hvd) -> None:
    r = hvd.rank()
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).cuda(
        hvd.local_rank())
    torch.nn.init.constant_(model[1].weight, float(r))
    model[0].weight.requires_grad_(False)  # frozen next to trainable (Horovod: grad None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    assert torch.all(model[1].weight == 1.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    assert model[0].weight.grad is None and model[0].weight not in opt.state
    for p in (model[0].bias, model[1].weight, model[1].bias):
        assert p.grad is not None and p.grad.device == dev_of(hvd) and not p.grad.any()
        assert opt.state[p]["exp_avg"].device == dev_of(hvd)


@pytest.mark.spmd
def test_scale_factors_in_half_precision_bit_exact(hvd) -> None:
    # Horovod's GPU arithmetic: float16 in half precision (the factor rounded to float16),
    # float32/float64 in their own type, integers through float64 truncated toward zero; the
    # prescale before the sum, the postscale after it. Same tensor on both ranks.
    n, dev = hvd.size(), dev_of(hvd)

    def scaled(t: torch.Tensor, f: float) -> torch.Tensor:
        if f == 1.0:
            return t
        if t.dtype == torch.float16:  # double -> float -> half, as __float2half((float)f)
            return t * torch.tensor(f, dtype=torch.float32).half().to(dev)
        if t.dtype.is_floating_point:
            return t * torch.tensor(f, dtype=t.dtype, device=dev)
        return (t.double() * f).trunc().to(t.dtype)

    for dt in (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64,
               torch.int8):
        if dt.is_floating_point:
            base = torch.linspace(-100.0, 100.0, 3 * (2 * n + 1), dtype=torch.float64) * 1.0137
        else:
            base = torch.arange(3 * (2 * n + 1), dtype=torch.float64) % 25 - 12
        x = base.reshape(2 * n + 1, 3).to(dt).cuda(hvd.local_rank())
        for pre, post in ((0.1, 1.0), (1.0, 0.3), (1 / 3, 0.7)):
            for op in (hvd.Sum, hvd.Average):
                p2 = post / n if op == hvd.Average else post
                want = scaled(scaled(x, pre) * n, p2)
                tag = f"{dt}.{pre:.3g}.{post:.3g}.{int(op)}"
                kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
                got = hvd.allreduce(x, name=f"dev.sc.{tag}", **kw)
                assert torch.equal(got, want), (tag, got, want)
                a, b = hvd.grouped_allreduce([x, x.flip(0).contiguous()], name=f"dev.gsc.{tag}",
                                             **kw)
                assert torch.equal(a, want) and torch.equal(b, want.flip(0)), tag
                rs = hvd.reducescatter(x, name=f"dev.rssc.{tag}", **kw)
                mine = want[:n + 1] if hvd.rank() == 0 else want[n + 1:]
                assert torch.equal(rs, mine), (tag, rs, mine)
                (grs,) = hvd.grouped_reducescatter([x], name=f"dev.grssc.{tag}", **kw)
                assert torch.equal(grs, mine), tag


@pytest.mark.spmd
def test_alltoall_received_splits_on_the_splits_device(hvd) -> None:
    n, dev = hvd.size(), dev_of(hvd)
    x = torch.arange(2 * n, dtype=torch.float32).reshape(2 * n, 1).cuda(hvd.local_rank())
    splits = torch.tensor([2] * n, dtype=torch.int32, device=dev)
    out, received = hvd.alltoall(x, splits, name="dev.a2a")
    assert received.device == dev and received.tolist() == [2] * n
    out, received = hvd.synchronize(hvd.alltoall_async(x, splits, name="dev.a2a.async"))
    assert received.device == dev and out.device == dev
    _, received = hvd.alltoall(x, [2] * n, name="dev.a2a.list")
    assert received.device.type == "cpu"  # a list of splits: on the CPU, as Horovod


@pytest.mark.spmd
def test_broadcast_grad_in_a_process_set(hvd) -> None:
    # 1 on the set's root rank, 0 elsewhere: the global set (root 1) and this rank's own
    # one-rank set.
    r = hvd.rank()
    for i, (ps, root) in enumerate([(hvd.global_process_set, 1), (SETS[r], r)]):
        x = torch.full((4,), float(r), device=dev_of(hvd), requires_grad=True)
        y = hvd.broadcast(x, root, name=f"dev.bcgrad.{i}", process_set=ps)
        assert torch.all(y.detach() == float(root))
        y.sum().backward()
        want = 1.0 if r == root else 0.0
        assert torch.equal(x.grad.cpu(), torch.full((4,), want)), (i, r, x.grad)


@pytest.mark.spmd
def test_error_types(hvd) -> None:
    from collective.engines.device import DeviceOpError
    r = hvd.rank()
    mixed = [torch.ones(2), torch.ones(2).cuda(hvd.local_rank())]
    with pytest.raises(RuntimeError, match="same device") as info:
        hvd.grouped_allreduce(mixed, name="dev.mixed")
    assert isinstance(info.value, (ValueError, DeviceOpError))
    with pytest.raises(hvd.HorovodInternalError, match="int16"):  # also a ValueError
        hvd.allreduce(torch.ones(4, dtype=torch.int16).cuda(hvd.local_rank()), op=hvd.Sum,
                      name="dev.int16")
    with pytest.raises(hvd.HorovodInternalError, match="(?i)shape"):
        hvd.allreduce(torch.ones(3 + r).cuda(hvd.local_rank()), name="dev.bad.shape")
    out = hvd.allreduce(torch.ones(5).cuda(hvd.local_rank()), op=hvd.Sum, name="dev.after")
    assert torch.all(out.cpu() == hvd.size())


@pytest.mark.spmd
def test_zz_a_second_device_fails_naming_both(hvd) -> None:
    # Last in this file: the error ends the runtime (a peer may have launched its half).
    # Both ranks use the other rank's GPU here, so both see their own message.
    r = hvd.rank()
    mine, other = hvd.local_rank(), 1 - hvd.local_rank()
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(3, device=f"cuda:{other}"), name="dev.second")
    text = str(info.value)
    assert f"is on cuda:{other}" in text and f"bound to cuda:{mine}" in text, text
    assert "InvalidResourceHandle" not in text, (r, text)
