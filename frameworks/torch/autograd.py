"""The differentiable collectives: `allreduce`, `grouped_allreduce`, `allgather`,
`grouped_allgather`, `broadcast`, `alltoall`, `reducescatter`, `grouped_reducescatter`.

Each wraps its async op in a `torch.autograd.Function` whose backward pass is Horovod's:

* allreduce: allreduce of the gradient with the same op and scale factors;
* allgather: allreduce (Average) of the gradient, then this rank's slice;
* broadcast: allreduce (Average) of the gradient, zero on non-root ranks;
* alltoall: alltoall of the gradient with the received splits (zeros for rows that
  `splits` left unsent);
* reducescatter: allgather of the gradient, times the set's size for Sum, times the factors.

Backward collectives are named after the forward op (`<name>.grad`) when it has a name, so they
match across ranks regardless of what else each rank enqueues. They are these differentiable
collectives themselves (as Horovod's), so that second derivatives (`create_graph=True`: gradient
penalties, Hessian-vector products) flow through them; without `create_graph` autograd runs the
backward pass without recording, and they cost what the plain op does.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from collective import ProcessSet, ReduceOp, RequestType, global_process_set, resolve_op

from ._buffers import run_one
from .compression import Compression, check_compressor
from .ops import (_splits_array, allgather_async, alltoall_async,
                  broadcast_async, grouped_allgather_async, grouped_allreduce_async,
                  grouped_reducescatter_async, process_set_rank, process_set_size,
                  reducescatter_async, wait_now)

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter"]


def _grad_name(name: str | None, suffix: str = "grad") -> str | None:
    return None if name is None else f"{name}.{suffix}"


class HorovodAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                post: float, ps: ProcessSet) -> torch.Tensor:
        ctx.name, ctx.op, ctx.pre, ctx.post, ctx.ps = name, op, pre, post, ps
        return _allreduce_new(tensor, name, op, pre, post, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out = HorovodAllreduce.apply(grad.contiguous(), _grad_name(ctx.name), ctx.op, ctx.pre,
                                     ctx.post, ctx.ps)
        return out, None, None, None, None, None


def _allreduce_new(tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                   post: float, ps: ProcessSet) -> torch.Tensor:
    """Synchronous out-of-place allreduce (what `allreduce_async` + `synchronize` return)."""
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    run_one(RequestType.ALLREDUCE, tensor, out, name, ps, op, pre, post)
    return out


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float,
                ps: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.name, ctx.op, ctx.pre, ctx.post, ctx.ps = name, op, pre, post, ps
        return tuple(wait_now(grouped_allreduce_async, list(tensors), None, name, op, pre, post,
                              ps))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        outs = HorovodGroupedAllreduce.apply(_grad_name(ctx.name), ctx.op, ctx.pre, ctx.post,
                                             ctx.ps, *[g.contiguous() for g in grads])
        return (None, None, None, None, None, *outs)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces `tensor` across the process set and returns a new tensor (input unchanged).

    Differentiable: the gradient is allreduced with the same op and factors.

    Raises:
        ValueError: not initialised, unsupported dtype, non-contiguous, op/average conflict.
        HorovodInternalError: the op failed on some rank (e.g. shapes differ across ranks).
    """
    op = resolve_op(op, average)
    check_compressor(compression)
    compressed, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduces a list atomically; returns new tensors. Differentiable.

    Raises:
        ValueError / HorovodInternalError: as `allreduce`.
    """
    op = resolve_op(op, average)
    check_compressor(compression)
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                         process_set, *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def _my_offset(dim0: int, name: str | None, ps: ProcessSet) -> int:
    dims = wait_now(allgather_async, torch.tensor([dim0], dtype=torch.int64),
                    _grad_name(name, "grad.dims"), ps)
    return int(dims[:process_set_rank(ps)].sum())


class HorovodAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                ps: ProcessSet) -> torch.Tensor:
        # A 0-d tensor is refused by the negotiation (every rank gets the same error).
        ctx.dim0, ctx.name, ctx.ps = (tensor.shape[0] if tensor.dim() else 0), name, ps
        return wait_now(allgather_async, tensor, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = HorovodAllreduce.apply(grad.contiguous(), _grad_name(ctx.name),
                                         ReduceOp.AVERAGE, 1.0, 1.0, ctx.ps)
        offset = _my_offset(ctx.dim0, ctx.name, ctx.ps)
        return reduced.narrow(0, offset, ctx.dim0), None, None


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, ps: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.dims, ctx.name, ctx.ps = [t.shape[0] if t.dim() else 0 for t in tensors], name, ps
        # Members with a gradient (the same on every rank: the ranks' dtypes agree); autograd
        # hands the others' outputs zeros, which are neither reduced nor returned.
        ctx.diff = [t.is_floating_point() or t.is_complex() for t in tensors]
        return tuple(wait_now(grouped_allgather_async, list(tensors), name, ps))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        keep = [i for i, d in enumerate(ctx.diff) if d]
        outs: list[torch.Tensor | None] = [None] * len(grads)
        if keep:
            reduced = HorovodGroupedAllreduce.apply(
                _grad_name(ctx.name), ReduceOp.AVERAGE, 1.0, 1.0, ctx.ps,
                *[grads[i].contiguous() for i in keep])
            dims = wait_now(allgather_async, torch.tensor([ctx.dims], dtype=torch.int64),
                            _grad_name(ctx.name, "grad.dims"), ctx.ps)
            before = dims[:process_set_rank(ctx.ps)].sum(0)
            for i, r in zip(keep, reduced):
                outs[i] = r.narrow(0, int(before[i]), ctx.dims[i])
        return (None, None, *outs)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's tensor along dim 0 (dim-0 sizes may differ; other dims must
    match). Differentiable.

    Raises:
        ValueError / HorovodInternalError: as `allreduce` (other dims differ across ranks).
    """
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """List form of `allgather`. Differentiable."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


class HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.name, ctx.ps = root_rank, name, ps
        return wait_now(broadcast_async, tensor, root_rank, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from collective import rank
        reduced = HorovodAllreduce.apply(grad.contiguous(), _grad_name(ctx.name),
                                         ReduceOp.AVERAGE, 1.0, 1.0, ctx.ps)
        if rank() != ctx.root:
            # Under create_graph, zeros that keep the graph: a second backward pass then runs
            # the same collectives on every rank (plain zeros would skip the root's allreduce
            # here).
            reduced = reduced * 0 if torch.is_grad_enabled() else torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns a copy of global rank `root_rank`'s tensor on every rank. Differentiable.

    Raises:
        ValueError: root not in the process set (plus `allreduce`'s errors).
    """
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


class HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                ps: ProcessSet) -> tuple:
        ctx.name, ctx.ps, ctx.dim0 = name, ps, tensor.shape[0] if tensor.dim() else 0
        out, received = wait_now(alltoall_async, tensor, splits, name, ps)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
        out, _r = HorovodAlltoall.apply(grad.contiguous(), ctx.received, _grad_name(ctx.name),
                                        ctx.ps)
        if out.shape[0] < ctx.dim0:  # splits left trailing rows unsent: their gradient is 0
            out = torch.cat([out, out.new_zeros((ctx.dim0 - out.shape[0], *out.shape[1:]))])
        return out, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatters dim-0 slices (`splits[r]` rows to rank r; even split when None) and gathers
    what every rank sent here. Returns `output`, or `(output, received_splits)` when `splits`
    is given. Differentiable.

    Raises:
        ValueError: bad splits (not whole row counts, wrong length, negative, too many rows).
    """
    arr = _splits_array(splits)
    out, received = HorovodAlltoall.apply(tensor, arr, name, process_set)
    if splits is None:
        return out
    if isinstance(splits, torch.Tensor) and received.device != splits.device:
        received = received.to(splits.device)  # as Horovod: on the device of `splits`
    return out, received


class HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, ps: ProcessSet,
                pre: float, post: float) -> torch.Tensor:
        ctx.name, ctx.op, ctx.ps, ctx.pre, ctx.post = name, op, ps, pre, post
        return wait_now(reducescatter_async, tensor, name, op, ps, pre, post)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _reducescatter_grad(ctx, [grad])[0], None, None, None, None, None


def _reducescatter_grad(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    factor = ctx.pre * ctx.post
    if ctx.op == ReduceOp.SUM:
        factor *= process_set_size(ctx.ps)
    grads = [g * factor if factor != 1.0 else g.contiguous() for g in grads]
    if len(grads) == 1 and not getattr(ctx, "grouped", False):
        return [HorovodAllgather.apply(grads[0], _grad_name(ctx.name), ctx.ps)]
    return list(HorovodGroupedAllgather.apply(_grad_name(ctx.name), ctx.ps, *grads))


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, ps: ProcessSet, pre: float,
                post: float, *tensors: torch.Tensor) -> tuple:
        ctx.name, ctx.op, ctx.ps, ctx.pre, ctx.post = name, op, ps, pre, post
        ctx.grouped = True
        return tuple(wait_now(grouped_reducescatter_async, list(tensors), name, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None, None, *_reducescatter_grad(ctx, grads))


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: ReduceOp = ReduceOp.AVERAGE,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces across the set, then returns this rank's share of dim 0. Differentiable.

    Raises:
        HorovodInternalError: op other than Sum or Average (plus `allreduce`'s errors).
    """
    check_compressor(compression)
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, ReduceOp(int(op)), process_set,
                                     prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: ReduceOp = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """List form of `reducescatter`. Differentiable."""
    check_compressor(compression)
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, ReduceOp(int(op)), process_set,
                                             prescale_factor, postscale_factor,
                                             *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]
