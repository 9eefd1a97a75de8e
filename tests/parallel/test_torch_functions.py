"""Broadcast helpers make diverged ranks identical; `SyncBatchNorm` equals plain batch norm on
the concatenated global batch (outputs, input gradients, summed weight gradients, running
statistics). Valid at any world size.
"""
from __future__ import annotations

import threading
import zlib

import pytest
import torch
from torch import nn

import horovod.torch as hvd
from tests.parallel._torch_util import PS_EVEN, PS_ODD, SIZE, all_equal, init_world

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def world():
    init_world()
    yield


def diverged_model() -> nn.Module:
    torch.manual_seed(100 + hvd.rank())  # different weights on every rank
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))


def test_broadcast_parameters_state_dict_and_lists():
    for root in {0, SIZE - 1}:
        model = diverged_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        for k, v in model.state_dict().items():
            assert all_equal(v, f"bp.sd.{root}.{k}"), k
        torch.manual_seed(100 + root)
        want = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(),
                             nn.Linear(12, 2))
        for (k, a), b in zip(model.state_dict().items(), want.state_dict().values()):
            assert torch.equal(a, b), k
    model = diverged_model()
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    assert all(all_equal(p, f"bp.named.{i}") for i, p in enumerate(model.parameters()))
    model = diverged_model()
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    assert all(all_equal(p, f"bp.list.{i}") for i, p in enumerate(model.parameters()))
    cl = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last) * hvd.rank()
    hvd.broadcast_parameters({"cl": cl}, root_rank=SIZE - 1)
    assert all_equal(cl.contiguous(), "bp.channels_last")
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(3, root_rank=0)


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9), amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "RMSprop": lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p),
}


def _state_blob(opt: torch.optim.Optimizer) -> bytes:
    import pickle
    sd = opt.state_dict()
    norm = {"groups": [{k: v for k, v in g.items()} for g in sd["param_groups"]],
            "state": {i: {k: (v.tolist(), str(v.dtype)) if torch.is_tensor(v) else
                          (v, type(v).__name__) for k, v in st.items()}
                      for i, st in sd["state"].items()}}
    return pickle.dumps(norm)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_broadcast_optimizer_state(name):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = OPTIMIZERS[name](model.parameters())
    # Diverge: different lr and a different number of local steps per rank (rank 1: none).
    opt.param_groups[0]["lr"] = 0.01 * (hvd.rank() + 1)
    for _ in range(0 if hvd.rank() == 1 else hvd.rank() + 1):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
    root_types = {k: type(v) for k, v in opt.param_groups[0].items() if k != "params"}
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    blobs = hvd.allgather_object(_state_blob(opt), name=f"bos.{name}")
    assert all(b == blobs[0] for b in blobs), f"{name}: state differs across ranks"
    assert opt.param_groups[0]["lr"] == 0.01
    for k, v in opt.param_groups[0].items():
        if k != "params" and hvd.rank() == 0:
            assert type(v) is root_types[k], k
    # the optimizer still steps after the broadcast, identically everywhere
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt.zero_grad()
    model(torch.ones(4, 3)).pow(2).sum().backward()
    opt.step()
    assert all_equal(model.weight, f"bos.after.{name}")


def test_a_failed_broadcast_of_several_tensors_leaves_no_handle_behind():
    # The first tensor's shapes differ across ranks: its broadcast fails on every rank; the
    # others' handles are waited for too instead of staying in the handle map with their
    # tensors for the life of the process.
    from frameworks.torch._handles import handles
    if SIZE == 1:
        pytest.skip("shapes can only differ across 2+ ranks")
    me = hvd.rank()
    before = len(handles)
    tensors = [torch.zeros(me + 1), torch.zeros(3), torch.zeros(2, 2)]
    with pytest.raises(hvd.HorovodInternalError):
        hvd.broadcast_parameters(tensors, root_rank=0)
    assert len(handles) == before


def test_objects_that_cannot_be_pickled_fail_on_every_rank():
    # The root's object (or one rank's, gathered) cannot be pickled: that rank raises its
    # pickling error and the others a ValueError naming it, instead of waiting for ever for
    # a broadcast the root never sent; the job goes on.
    me = hvd.rank()
    with pytest.raises(Exception) as info:
        hvd.broadcast_object(threading.Lock() if me == 0 else None, root_rank=0,
                             name="unpicklable.bcast")
    if me == 0:
        assert "lock" in str(info.value).lower()
    else:
        assert info.type is ValueError and "root rank 0 could not pickle" in str(info.value)
    bad = SIZE - 1
    with pytest.raises(Exception) as info:
        hvd.allgather_object(threading.Lock() if me == bad else me, name="unpicklable.ag")
    if me != bad:
        assert info.type is ValueError and f"rank(s) {bad} could not pickle" in str(info.value)
    assert hvd.broadcast_object({"ok": me}, root_rank=0, name="after.unpicklable") == {"ok": 0}
    assert hvd.allgather_object(me, name="after.unpicklable.ag") == list(range(SIZE))


def test_broadcast_optimizer_state_special_cases():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)
    # all ranks fresh: the state is created as Horovod does (zero gradients, one plain step),
    # which leaves the parameters alone for Adam, then the root's is broadcast
    opt = torch.optim.Adam(model.parameters(), lr=0.001 * (hvd.rank() + 1))
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 2 and opt.param_groups[0]["lr"] == 0.001
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    # a DistributedOptimizer and a sparse optimizer
    emb = nn.Embedding(5, 2, sparse=True)
    sparse = torch.optim.SparseAdam(emb.parameters())
    if hvd.rank() == 0:
        emb(torch.tensor([1, 2])).sum().backward()
        sparse.step()
    hvd.broadcast_optimizer_state(sparse, root_rank=0)
    blobs = hvd.allgather_object(_state_blob(sparse), name="bos.sparse")
    assert all(b == blobs[0] for b in blobs)
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    hvd.broadcast_optimizer_state(dopt, root_rank=0)


def test_broadcast_optimizer_state_creating_state_leaves_the_parameters_alone():
    # The plain step on zero gradients that creates an empty state moved the parameters with
    # weight decay on the ranks that took it (here the non-root ranks, after the parameters'
    # broadcast, as in a resumed job or an elastic worker joining): they then differed from
    # the root's for the rest of training. Existing gradients are kept too.
    torch.manual_seed(hvd.rank())
    model = nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for make in (lambda: torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5),
                 lambda: torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)):
        opt = make()
        if hvd.rank() == 0:  # the root's state exists (a step with zero gradients)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            with torch.no_grad():
                for p, b in zip(model.parameters(), before):
                    p.copy_(b)
        model.weight.grad = torch.ones_like(model.weight)  # accumulated, not yet stepped
        before = [p.detach().clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert torch.equal(model.weight.grad, torch.ones_like(model.weight))
        assert all_equal(model.weight, f"bos.still.{type(opt).__name__}")


def test_broadcast_optimizer_state_frozen_parameter():
    # A parameter with requires_grad=False next to one that requires grad: the first gets a
    # zero gradient and state, the frozen one keeps grad None and gets no state (Horovod).
    torch.manual_seed(hvd.rank())
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    makers = (lambda: torch.optim.Adam(model.parameters(), lr=0.01),
              lambda: hvd.DistributedOptimizer(
                  torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                  named_parameters=model.named_parameters()))
    for make in makers:  # the DistributedOptimizer's hooks exist only in its own round
        opt = make()
        for p in model.parameters():
            p.grad = None
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert model[0].weight.grad is None
        assert model[0].weight not in opt.state
        for p in (model[0].bias, model[1].weight, model[1].bias):
            assert p.grad is not None and not p.grad.any()
            assert p in opt.state
        blobs = hvd.allgather_object(_state_blob(opt), name="bos.frozen")
        assert all(b == blobs[0] for b in blobs)
        # training goes on (the DistributedOptimizer's step allreduces on every rank)
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()


def test_broadcast_optimizer_state_mismatch_fails_everywhere():
    # The last rank's optimizer has more parameters; then the root's state holds a tensor it
    # cannot send. Either way every rank raises, naming the ranks, instead of the others
    # waiting for broadcasts that never come.
    if SIZE == 1:
        pytest.skip("needs a second rank")
    last = SIZE - 1
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(2 if hvd.rank() == last else 1)])
    with pytest.raises(ValueError, match=rf"failed on rank\(s\) \[{last}\]: rank {last}'s "
                                         "optimizer has 1 param groups and 4 parameters, the "
                                         "root's has 1 and 2"):
        hvd.broadcast_optimizer_state(torch.optim.Adam(model.parameters()), root_rank=0)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    if hvd.rank() == 0:
        opt.state[model.weight]["extra"] = torch.zeros(2).to_sparse()
    with pytest.raises(ValueError, match="failed on root rank 0: cannot broadcast "
                                         "torch.sparse_coo optimizer state 'extra'"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="bos.mismatch.after").item() == SIZE


def test_broadcast_optimizer_state_unpicklable_root_state_fails_everywhere():
    # An option the root cannot serialise (a lock): the root raises its own TypeError, every
    # other rank a ValueError naming the root and the cause, instead of waiting for the root's
    # broadcast.
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.param_groups[0]["lock"] = threading.Lock()
    if hvd.rank() == 0:
        with pytest.raises(TypeError, match="lock"):
            hvd.broadcast_optimizer_state(opt, root_rank=0)
    else:
        with pytest.raises(ValueError, match=r"^broadcast_optimizer_state failed on root rank "
                                             r"0: TypeError\(.*lock"):
            hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="bos.unpicklable.after").item() == SIZE


def test_broadcast_and_allgather_object():
    obj = {"rank": hvd.rank(), "f": (lambda x: x + 1), "t": torch.arange(3)}
    for root in range(SIZE):
        got = hvd.broadcast_object(obj if hvd.rank() == root else None, root_rank=root)
        assert got["rank"] == root and got["f"](1) == 2 and torch.equal(got["t"], obj["t"])
    assert hvd.broadcast_object(None, 0, name="none") is None
    big = bytes(range(256)) * 5000
    assert hvd.broadcast_object(big if hvd.rank() == 0 else b"", 0, name="big") == big
    got = hvd.allgather_object({"r": hvd.rank(), "pad": "x" * hvd.rank() * 100})
    assert [g["r"] for g in got] == list(range(SIZE))
    assert [len(g["pad"]) for g in got] == [r * 100 for r in range(SIZE)]
    ps = PS_EVEN if hvd.rank() % 2 == 0 else PS_ODD
    assert hvd.allgather_object(hvd.rank(), name="ps.obj", process_set=ps) == ps.ranks
    assert hvd.broadcast_object(hvd.rank(), ps.ranks[-1], name="ps.bobj",
                                process_set=ps) == ps.ranks[-1]


# -- SyncBatchNorm ------------------------------------------------------------------------------
def _bn_case(shape_tail: tuple[int, ...], rows_of, affine: bool, momentum, dtype, seed: int):
    c = shape_tail[0]
    rows = [rows_of(r) for r in range(SIZE)]
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(sum(rows), *shape_tail, generator=g, dtype=torch.float64) * 3 + 5
    full = full.to(dtype)
    dy_full = torch.randn(full.shape, generator=g, dtype=torch.float64).to(dtype)
    start = sum(rows[:hvd.rank()])
    mine = slice(start, start + rows[hvd.rank()])
    sync = hvd.SyncBatchNorm(c, affine=affine, momentum=momentum).to(dtype)
    plain = nn.BatchNorm1d(c, affine=affine, momentum=momentum).to(dtype) if len(shape_tail) \
        <= 2 else (nn.BatchNorm2d if len(shape_tail) == 3 else nn.BatchNorm3d)(
            c, affine=affine, momentum=momentum).to(dtype)
    if affine:
        with torch.no_grad():
            w = torch.linspace(0.5, 2, c, dtype=dtype)
            sync.weight.copy_(w)
            plain.weight.copy_(w)
            sync.bias.fill_(0.3)
            plain.bias.fill_(0.3)
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for it in range(2):
        x = full[mine].clone().requires_grad_(True)
        xf = full.clone().requires_grad_(True)
        y = sync(x)
        yf = plain(xf)
        torch.testing.assert_close(y, yf[mine], rtol=tol, atol=tol)
        (y * dy_full[mine]).sum().backward()
        (yf * dy_full).sum().backward()
        torch.testing.assert_close(x.grad, xf.grad[mine], rtol=tol, atol=tol)
        if affine:
            gw = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name=f"bn.gw.{seed}.{it}")
            gb = hvd.allreduce(sync.bias.grad, op=hvd.Sum, name=f"bn.gb.{seed}.{it}")
            torch.testing.assert_close(gw, plain.weight.grad, rtol=tol, atol=tol * 10)
            torch.testing.assert_close(gb, plain.bias.grad, rtol=tol, atol=tol * 10)
            sync.zero_grad()
            plain.zero_grad()
    torch.testing.assert_close(sync.running_mean, plain.running_mean, rtol=tol, atol=tol)
    torch.testing.assert_close(sync.running_var, plain.running_var, rtol=tol, atol=tol)
    assert int(sync.num_batches_tracked) == int(plain.num_batches_tracked) == 2
    # eval mode uses the running statistics, locally
    sync.eval()
    plain.eval()
    torch.testing.assert_close(sync(full[mine]), plain(full)[mine], rtol=tol, atol=tol)


@pytest.mark.parametrize("case", [
    ("2d", (3, 4, 5), lambda r: 2, True, 0.1, torch.float32),
    ("1d-uneven", (4,), lambda r: r + 2, True, 0.1, torch.float64),
    ("3d-cumulative", (2, 2, 3, 2), lambda r: 1 + r % 2, False, None, torch.float32),
    ("seq-bf16", (3, 6), lambda r: 2, True, 0.3, torch.bfloat16),
], ids=lambda c: c[0])
def test_sync_batch_norm_matches_global_batch_norm(case):
    label, tail, rows_of, affine, momentum, dtype = case
    _bn_case(tail, rows_of, affine, momentum, dtype, seed=zlib.crc32(label.encode()) % 1000)


def test_sync_batch_norm_refuses_a_second_derivative():
    """Its backward uses statistics saved outside the graph: a second derivative (a gradient
    penalty) raises instead of silently missing terms; a first one under create_graph works.
    Alone (one rank) it is torch's batch norm, which has second derivatives."""
    bn = hvd.SyncBatchNorm(3)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(hvd.rank())).requires_grad_()
    (gx,) = torch.autograd.grad(bn(x).pow(3).sum(), x, create_graph=True)
    assert gx.shape == x.shape
    if SIZE == 1:
        gx.pow(2).sum().backward()
        assert x.grad is not None
        return
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.pow(2).sum().backward()


def test_a_model_holding_the_global_process_set_copies_and_pickles():
    """deepcopy (EMA models, best-model copies) and torch.save/torch.load of a model whose
    SyncBatchNorm holds the global set: the copies hold the one global set (unpickling made
    another object; registered sets: tests/unit/test_process_sets.py)."""
    import copy
    import io
    model = nn.Sequential(nn.Linear(2, 3), hvd.SyncBatchNorm(3))
    assert copy.deepcopy(model)[1].process_set is hvd.global_process_set
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded[1].process_set is hvd.global_process_set
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(hvd.rank()))
    torch.testing.assert_close(loaded(x), model(x))


def test_sync_batch_norm_in_a_model_with_distributed_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), hvd.SyncBatchNorm(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(2):
        x = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(step * 10 +
                                                                             hvd.rank()))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert all_equal(v, f"syncbn.model.{k}"), k
    with pytest.raises(ValueError, match="expected at least 2D input"):
        hvd.SyncBatchNorm(3)(torch.ones(3))


def test_sync_batch_norm_one_value_per_channel_fails_on_every_rank():
    """As BatchNorm over the global batch: training statistics of 1 value per channel (here
    across all ranks) raise torch's ValueError, on every rank alike (no rank left waiting),
    and leave the running statistics alone; 1 value on each of several ranks is fine."""
    me = hvd.rank()
    bn = hvd.SyncBatchNorm(3)
    for shape in ((1, 3), (1, 3, 1, 1)):  # rank 0 holds the only value; the others none
        x = torch.randn(*shape) if me == 0 else torch.randn(0, *shape[1:])
        with pytest.raises(ValueError, match="^Expected more than 1 value per channel when "
                                             "training") as info:
            bn(x)
        if SIZE > 1:
            msg = str(info.value)
            for part in (f"rank {me}", f"{SIZE} ranks", "rank 0: 1", f"rank {SIZE - 1}: 0",
                         "eval mode"):
                assert part in msg, (part, msg)
        assert torch.equal(bn.running_mean, torch.zeros(3))
        assert torch.equal(bn.running_var, torch.ones(3))
    # The layer goes on working, in step on every rank.
    full = torch.randn(max(SIZE, 2), 3, generator=torch.Generator().manual_seed(7))
    rows = full[me:me + 1] if SIZE > 1 else full  # one row each (two alone)
    plain = nn.BatchNorm1d(3)
    torch.testing.assert_close(bn(rows), plain(full)[me:me + 1] if SIZE > 1 else plain(full))
    torch.testing.assert_close(bn.running_var, plain.running_var)
    bn.eval()  # eval mode uses the running statistics: one value is fine
    assert bn(full[:1]).shape == (1, 3)
