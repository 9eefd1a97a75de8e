"""Single-process tests of the torch adapter: the `horovod` alias package, the tensor seam,
compression, naming helpers, int handles, elastic state and sampler, and the optimizer wrapper's logic
with more than one rank (loopback: N threads act as N ranks).
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import frameworks.torch as ft  # noqa: E402
from collective import DataType  # noqa: E402
from frameworks import _common  # noqa: E402
from frameworks.torch import _buffers  # noqa: E402
from frameworks.torch._handles import HandleMap  # noqa: E402
from tests._spmd import REPO, run_loopback  # noqa: E402


def test_horovod_aliases_are_the_same_modules():
    code = (
        "import sys, horovod\n"
        "assert 'torch' not in sys.modules, 'importing horovod must not import torch'\n"
        "import horovod.torch as hvd, frameworks.torch as ft\n"
        "import horovod.torch.optimizer, horovod.torch.mpi_ops, horovod.torch.elastic\n"
        "import horovod.torch.ops\n"
        "from horovod.torch.functions import broadcast_object\n"
        "assert hvd is ft and horovod.torch is ft\n"
        "for sub in ('optimizer', 'mpi_ops', 'functions', 'elastic', 'ops'):\n"
        "    assert sys.modules['horovod.torch.' + sub] is sys.modules['frameworks.torch.' + sub]\n"
        "assert broadcast_object is ft.broadcast_object\n"
        "assert ft.__spec__.name == 'frameworks.torch'\n"
        "assert horovod.__version__.startswith('0.28.1+ringvod.')\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_horovod_torch_elastic_submodules():
    """Horovod's split of `horovod.torch.elastic`: `.sampler` and `.state`, imported as user
    scripts do; `hvd.elastic` keeps every name."""
    from horovod.torch.elastic import ElasticSampler as Sampler0
    from horovod.torch.elastic import TorchState as State0
    from horovod.torch.elastic import run
    from horovod.torch.elastic.sampler import ElasticSampler
    from horovod.torch.elastic.state import (ModelStateHandler, OptimizerStateHandler,
                                             SamplerStateHandler, StateHandler, TorchState,
                                             get_handler_registry, set_handler_registry)

    import horovod.torch as hvd
    import horovod.torch.elastic.state as state_mod

    assert ElasticSampler is Sampler0 is hvd.elastic.ElasticSampler
    assert TorchState is State0 is hvd.elastic.TorchState and run is hvd.elastic.run
    assert state_mod is importlib.import_module("frameworks.torch.elastic.state")
    assert get_handler_registry() == [(torch.nn.Module, ModelStateHandler),
                                      (torch.optim.Optimizer, OptimizerStateHandler),
                                      (ElasticSampler, SamplerStateHandler)]
    assert issubclass(ModelStateHandler, StateHandler) and callable(set_handler_registry)
    for name in ("State", "ObjectState", "HostUpdateResult", "get_handler_registry",
                 "set_handler_registry", "StateHandler"):
        assert hasattr(hvd.elastic, name), name


def test_exported_names():
    for name in ["init", "shutdown", "allreduce", "allreduce_async_", "grouped_allreduce",
                 "sparse_allreduce_async", "allgather", "broadcast_", "alltoall",
                 "reducescatter", "grouped_reducescatter_async", "barrier", "join", "poll",
                 "synchronize", "Compression", "DistributedOptimizer", "SyncBatchNorm",
                 "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
                 "allgather_object", "elastic", "ProcessSet", "global_process_set",
                 "add_process_set", "remove_process_set", "HorovodInternalError",
                 "start_timeline", "stop_timeline", "nccl_built", "Average", "Sum"]:
        assert hasattr(ft, name), name
    assert not hasattr(ft, "is_homogeneous") and hasattr(ft.mpi_ops, "is_homogeneous")


@pytest.mark.parametrize("dtype,want", [
    (torch.uint8, DataType.UINT8), (torch.int8, DataType.INT8), (torch.int16, DataType.INT16),
    (torch.int32, DataType.INT32), (torch.int64, DataType.INT64),
    (torch.float16, DataType.FLOAT16), (torch.bfloat16, DataType.BFLOAT16),
    (torch.float32, DataType.FLOAT32), (torch.float64, DataType.FLOAT64),
    (torch.bool, DataType.BOOL)])
def test_to_collective_shares_memory(dtype, want):
    t = torch.zeros(2, 3, dtype=dtype)
    args = _buffers.to_collective(t, output=t)
    assert args.dtype == want and args.shape == (2, 3) and args.device == -1
    assert args.ready_event is None and args.output is not None
    one = torch.ones(1, dtype=dtype)
    args.output.reshape(-1)[1] = _buffers.to_collective(one).tensor[0]  # bits of 1 (bf16: uint16)
    assert t.reshape(-1)[1].item() == 1, "the view writes through to the torch tensor"
    back = _buffers.from_collective(np.array(args.tensor), t)
    assert back.dtype == dtype and torch.equal(back, t)


def test_seam_errors():
    with pytest.raises(ValueError, match="Tensor type torch.ComplexDoubleTensor is not supported"):
        _buffers.to_collective(torch.zeros(2, dtype=torch.complex128))
    with pytest.raises(ValueError, match="contiguous"):
        _buffers.to_collective(torch.zeros(3, 3).t())
    with pytest.raises(TypeError, match="torch.Tensor"):
        _buffers.to_collective(np.zeros(3))
    with pytest.raises(ValueError, match="tensors on meta are not supported"):
        _buffers.to_collective(torch.zeros(2, device="meta"))


def test_compression():
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)
    for comp, wire in ((ft.Compression.fp16, torch.float16), (ft.Compression.bf16, torch.bfloat16)):
        c, ctx = comp.compress(x)
        assert c.dtype == wire
        back = comp.decompress(c, ctx)
        assert back.dtype == torch.float64
        torch.testing.assert_close(back, x, rtol=1e-2, atol=1e-2)
    c, ctx = ft.Compression.none.compress(x)
    assert c is x and ft.Compression.none.decompress(c, ctx) is x
    # Horovod's ctx is the input's dtype whatever it is: already float16, or not floating.
    for comp in (ft.Compression.fp16, ft.Compression.bf16):
        for t in (torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16),
                  torch.arange(3)):
            c, ctx = comp.compress(t)
            assert ctx == t.dtype
            assert comp.decompress(c, ctx).dtype == t.dtype
    ints = torch.arange(3)
    assert ft.Compression.fp16.compress(ints) == (ints, torch.int64)


def test_common_helpers():
    assert _common.find_duplicates(["a", "b", "a", "c", "b", "a"]) == ["a", "b"]
    assert _common.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert _common.split_list([1], 4) == [[1]]
    assert _common.default_parameter_name(1, 2) == "allreduce.noname.1.2"
    f = lambda v: v * 3  # noqa: E731 - cloudpickle handles lambdas
    assert _common.loads(_common.dumps(f))(2) == 6
    with pytest.raises(ValueError, match="tuples"):
        _common.check_named_parameters([["a", 1]], set())


def test_handle_map():
    from collective.handle import Handle
    m = HandleMap()
    h = Handle("x")
    hid = m.add(h, lambda r: r + 1, object())
    assert not m.poll(hid)
    h._set_result(41)
    assert m.poll(hid) and m.synchronize(hid) == 42 and len(m) == 0
    with pytest.raises(ValueError, match="unknown handle"):
        m.synchronize(hid)


def test_elastic_state_and_sampler_single_process():
    assert importlib.import_module("horovod.torch.elastic") is ft.elastic
    ft.init()
    try:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sampler = ft.elastic.ElasticSampler(list(range(10)), shuffle=False)
        state = ft.elastic.TorchState(model, opt, sampler=sampler, epoch=0, seen=[])
        w0 = model.weight.detach().clone()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        state.epoch = 3
        state.seen.append(1)  # in-place change after the snapshot: not in the commit
        sampler.record_batch(0, 4)
        state.restore()
        assert torch.equal(model.weight, w0) and not opt.state_dict()["state"]
        assert state.epoch == 0 and state.seen == [] and sampler.processed_num == 0
        sampler.record_batch(0, 4)
        state.epoch = 1
        state.commit()
        sampler.reset()
        assert list(iter(sampler)) == list(range(4, 10)) and len(sampler) == 6
        calls = []
        state.register_reset_callbacks([lambda: calls.append(1)])
        state.on_reset()
        assert calls == [1]
        state.sync()  # one rank: a broadcast to itself
        assert state.epoch == 1 and sampler.state_dict() == {"epoch": 0, "processed_num": 4}
        sampler.set_epoch(1)
        assert sampler.processed_num == 0 and sorted(sampler) == list(range(10))
    finally:
        ft.shutdown()


def test_torch_state_without_model_or_optimizer():
    """As in Horovod, a model or optimizer not given is a plain `None` attribute: saved,
    restored and synced like any other value."""
    ft.init()
    try:
        state = ft.elastic.TorchState(epoch=0)
        assert state.model is None and state.optimizer is None
        state.epoch = 2
        state.restore()
        assert (state.model, state.optimizer, state.epoch) == (None, None, 0)
        state.epoch = 1
        state.commit()
        state.sync()
        assert (state.model, state.optimizer, state.epoch) == (None, None, 1)
        model = torch.nn.Linear(2, 1)
        only_model = ft.elastic.TorchState(model, batch=0)
        assert only_model.model is model and only_model.optimizer is None
        only_model.commit()
        only_model.sync()
        only_model.restore()
        assert only_model.optimizer is None
    finally:
        ft.shutdown()


def test_single_process_ops_and_optimizer():
    ft.init()
    try:
        assert ft.size() == 1
        x = torch.arange(4.0)
        assert torch.equal(ft.allreduce(x), x)
        assert torch.equal(ft.allgather(x.view(2, 2)), x.view(2, 2))
        model = torch.nn.Linear(2, 1)
        opt = ft.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        bn = ft.SyncBatchNorm(3)
        y = torch.randn(4, 3)
        torch.testing.assert_close(bn(y), torch.nn.BatchNorm1d(3)(y))
    finally:
        ft.shutdown()


def test_num_groups_warning_points_at_the_callers_line():
    """The deprecation warning names the user's line, whichever way the wrapper is built."""
    ft.init()
    try:
        model = torch.nn.Linear(2, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        cls = type(ft.DistributedOptimizer(sgd))
        for make in (lambda: ft.DistributedOptimizer(sgd, num_groups=1),
                     lambda: cls(model.parameters(), lr=0.1, num_groups=1)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                make()
            [w] = [w for w in caught if issubclass(w.category, DeprecationWarning)]
            assert "`num_groups` has been replaced by `groups`" in str(w.message)
            assert (w.filename, w.lineno) == (__file__, make.__code__.co_firstlineno)
    finally:
        ft.shutdown()


def test_optimizer_hooks_with_loopback_ranks():
    """Two threads as two ranks: gradients are averaged and the hooks' rules hold."""
    def body(rank: int):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        opt = ft.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                      named_parameters=model.named_parameters())
        (model(torch.ones(1, 3)) * (rank + 1)).sum().backward()
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
        opt.synchronize()
        grad = model.weight.grad.clone()
        with opt.skip_synchronize():
            opt.step()
        return grad

    g0, g1 = run_loopback(2, body, timeout=60)
    torch.testing.assert_close(g0, torch.full((1, 3), 1.5))
    assert torch.equal(g0, g1)


def test_add_param_group_after_wrapping_is_averaged():
    """Parameters added after wrapping get hooks too (Horovod left them out)."""
    def body(rank: int):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
        opt = ft.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=1.0))
        opt.add_param_group({"params": b.parameters()})
        x = torch.ones(1, 2) * (rank + 1)
        (a(x) + b(x)).sum().backward()
        opt.synchronize()
        return a.weight.grad.clone(), b.weight.grad.clone()

    (a0, b0), (a1, b1) = run_loopback(2, body, timeout=60)
    torch.testing.assert_close(b0, torch.full((1, 2), 1.5))
    assert torch.equal(a0, a1) and torch.equal(b0, b1)


class _Schedule:
    """A bucket schedule's interface as the reducer uses it."""

    def __init__(self) -> None:
        self.closed, self.steps = False, 0

    def step_done(self) -> float:
        self.steps += 1
        return 0.0

    def close(self) -> None:
        self.closed = True


def test_a_failed_synchronize_stops_bucket_tuning_instead_of_counting_a_step():
    from collective import ReduceOp, global_process_set
    from collective.errors import HorovodInternalError
    from frameworks.torch._reducer import GradientReducer

    def reducer():
        return GradientReducer(ft.Compression.none, ReduceOp.AVERAGE, (1.0, 1.0),
                               global_process_set, False, 1)
    ok = reducer()
    ok.schedule = sched = _Schedule()
    ok.synchronize()
    assert sched.steps == 1 and not sched.closed
    bad = reducer()
    bad.schedule = sched = _Schedule()
    bad.members = [object()]  # a gradient set whose wait fails

    def fail() -> None:
        raise HorovodInternalError("a peer died")
    bad._finish_set = fail
    with pytest.raises(HorovodInternalError, match="a peer died"):
        bad.synchronize()
    assert sched.closed and sched.steps == 0 and bad.schedule is None


def test_join_docstring_is_the_collective_one():
    """horovod.torch.join documents itself with collective.join's text (one source)."""
    import collective.ops
    from frameworks.torch import ops
    assert ops.join.__doc__ == collective.ops.join.__doc__
    assert "Join covers the global process set only" in ft.join.__doc__


def test_elastic_reset_forgets_the_old_worlds_int_handles(monkeypatch):
    # As torch's shutdown() and init(): async ops never synchronized before a failure are
    # forgotten with their tensors when hvd.elastic.run resets the job (they leaked, and a
    # stale handle gave the old world's error).
    import frameworks.torch.elastic as el
    from frameworks.torch._handles import handles
    calls = []
    monkeypatch.setattr(el, "_reset", lambda: calls.append(len(handles)))
    handles._pending[12345] = object()
    try:
        el._torch_reset()
        assert calls == [0] and len(handles) == 0
    finally:
        handles._pending.pop(12345, None)
