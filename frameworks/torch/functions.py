"""Helpers that make ranks agree: `broadcast_parameters`, `broadcast_optimizer_state`,
`broadcast_object`, `allgather_object`.

`broadcast_optimizer_state` sends rank root's whole optimizer state: every scalar (lr, betas,
step counts, flags) travels pickled in one object, so it keeps its type; every state tensor is
broadcast in place (allocated first where a rank lacks it). An empty state is first created as
Horovod does: zero gradients and one plain `step()` (`_initialize_state`).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import collective
from collective import ProcessSet, global_process_set

from .. import _common
from .._common import dumps, loads
from .ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def _broadcast_tensors(named: list[tuple[str, torch.Tensor]], root_rank: int,
                       process_set: ProcessSet = global_process_set) -> None:
    """Broadcasts tensors in place: all ops are started first, then waited for."""
    pending = []
    for name, t in named:
        send = t if t.is_contiguous() else t.contiguous()
        pending.append((t, send, broadcast_async_(send, root_rank, name, process_set)))
    error: BaseException | None = None
    for t, send, h in pending:
        try:
            synchronize(h)
        except Exception as exc:  # noqa: BLE001 - raised below, once every handle is done
            if error is None:
                error = exc
            continue
        if send is not t and error is None:
            with torch.no_grad():
                t.copy_(send)
    if error is not None:  # every handle was waited for (none left in the handle map)
        raise error


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrites every rank's tensors with rank `root_rank`'s, in place.

    Args:
        params: a `state_dict()` (broadcast sorted by key, named by key), or a list of tensors or
            of (name, tensor) pairs such as `list(model.named_parameters())`.
        root_rank: global rank whose values win.

    Raises:
        ValueError: `params` is neither a dict nor an iterable of tensors / (name, tensor).
        HorovodInternalError: ranks passed different shapes or dtypes for a name.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    named = []
    for i, (name, t) in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"invalid params of type: {type(t)} (entry {name or i})")
        named.append((str(name) if name is not None else f"broadcast_parameters.{i}", t))
    _broadcast_tensors(named, root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns rank `root_rank`'s `obj` (cloudpickled) on every rank of the process set.

    The size travels as `<name>.sz`, the bytes as `<name>.t`. `name` defaults to
    "broadcast_object" (Horovod used `type(obj).__name__`, which differs between the root's object
    and the placeholders other ranks pass, and then never matched).

    Raises:
        ValueError: the root's object cannot be pickled (the root raises its pickling error).
        HorovodInternalError: the broadcast failed on some rank.
    """
    return _common.broadcast_object(obj, root_rank, name or "broadcast_object", process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Returns the list of every rank's `obj`, indexed by rank in the process set.

    `name` defaults to "allgather_object" (see `broadcast_object` for why not the type name).

    Raises:
        ValueError: some rank's object cannot be pickled (that rank raises its pickling error).
        HorovodInternalError: the allgather failed on some rank.
    """
    return _common.allgather_object(obj, name or "allgather_object", process_set)


# -- optimizer state -------------------------------------------------------------------------------
def _initialize_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """A new optimizer has no state yet: create it as Horovod does, with one step of the plain
    optimizer on zero gradients (sparse for SparseAdam; parameters that do not require grad get
    no state), which leaves a zero gradient where there was none. Unlike Horovod's, the step
    leaves the parameters and any existing gradients as they were: with weight decay it would
    move the parameters of the ranks whose state was empty only (a worker that joined an
    elastic job after the model's sync, the non-root ranks of a resumed job after
    `broadcast_parameters`), and they would differ from the root's for the rest of
    training."""
    trained = [p for p in params if p.requires_grad]
    saved = [(p, p.detach().clone(), p.grad) for p in trained]
    for p in trained:
        zero = torch.zeros_like(p, memory_format=torch.contiguous_format)
        p.grad = zero.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else zero
    from .optimizer import _DistributedOptimizer
    try:
        if isinstance(optimizer, _DistributedOptimizer):
            # Its step() would allreduce every gradient, and other ranks may not step here.
            super(_DistributedOptimizer, optimizer).step()
        else:
            optimizer.step()
    finally:
        with torch.no_grad():
            for p, value, grad in saved:
                p.copy_(value)
                if grad is not None:
                    p.grad = grad


def _state_layout(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict:
    """Root side: group options, and per parameter index its state (tensor specs or values)."""
    state = {}
    for i, p in enumerate(params):
        st = optimizer.state.get(p)
        if not st:
            continue
        entry = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                if v.layout != torch.strided:
                    raise ValueError(f"cannot broadcast {v.layout} optimizer state {k!r}")
                entry[k] = ("tensor", tuple(v.shape), v.dtype, v.device == p.device)
            else:
                entry[k] = ("value", v)
        state[i] = entry
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"options": options, "state": state, "nparams": len(params),
            "ngroups": len(optimizer.param_groups)}


def _apply_layout(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                  layout: dict) -> None:
    """Non-root side: match root's options and state structure (tensors allocated, not set)."""
    me = collective.rank()
    if layout["ngroups"] != len(optimizer.param_groups) or layout["nparams"] != len(params):
        raise ValueError(
            f"rank {me}'s optimizer has {len(optimizer.param_groups)} param groups and "
            f"{len(params)} parameters, the root's has {layout['ngroups']} and "
            f"{layout['nparams']}; build the optimizer identically on every rank")
    for group, options in zip(optimizer.param_groups, layout["options"]):
        for k in [k for k in group if k != "params" and k not in options]:
            del group[k]
        group.update({k: _on_local_device(v, group.get(k), group["params"])
                      for k, v in options.items()})
    for i, p in enumerate(params):
        spec = layout["state"].get(i)
        if spec is None:
            optimizer.state.pop(p, None)
            continue
        old = optimizer.state.get(p) or {}
        new = {}
        for k, item in spec.items():
            if item[0] == "value":
                new[k] = item[1]
                continue
            _, shape, dtype, on_param_device = item
            device = p.device if on_param_device else torch.device("cpu")
            cur = old.get(k)
            if (torch.is_tensor(cur) and tuple(cur.shape) == shape and cur.dtype == dtype
                    and cur.device == device and cur.layout == torch.strided):
                new[k] = cur
            else:
                new[k] = torch.empty(shape, dtype=dtype, device=device)
        optimizer.state[p] = new


def _on_local_device(value: Any, local: Any, params: list[torch.Tensor]) -> Any:
    """A group option from the root, for this rank: a tensor option (a tensor `lr` of a
    capturable or fused optimizer) arrives on the root's device index, which is another GPU
    where every rank sees every GPU; it goes where this rank's own option is, or beside this
    rank's parameters when it was on the root's GPU."""
    if not torch.is_tensor(value):
        return value
    if torch.is_tensor(local):
        return value.to(local.device)
    if value.device.type != "cpu" and params:
        return value.to(params[0].device)
    return value


def _describe(exc: Exception) -> str:
    """A failure as another rank's error text shows it (a ValueError's text is enough)."""
    return str(exc) if isinstance(exc, ValueError) else repr(exc)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Makes every rank's optimizer state (options and per-parameter state) equal to the root's.

    Works for every optimizer whose state is a dict of tensors and scalars per parameter (all of
    `torch.optim` except LBFGS). `model` is accepted for Horovod compatibility and unused.

    Raises:
        ValueError: LBFGS, or the optimizers differ in their number of groups or parameters,
            or the root's state cannot be broadcast (nor pickled); on every rank, naming the
            ranks. Where the root's failure is not a ValueError (e.g. the TypeError of an
            unpicklable option), the root raises that exception itself.
        HorovodInternalError: a broadcast failed.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not optimizer.state:
        _initialize_state(optimizer, params)
    is_root = collective.rank() == root_rank
    layout, sent, failure = None, None, None
    if is_root:
        try:
            layout = _state_layout(optimizer, params)
            sent = dumps(layout)  # here, so that a failure to pickle reaches every rank too
        except Exception as e:  # the other ranks learn it from the broadcast
            failure = e
            sent = f"broadcast_optimizer_state failed on root rank {root_rank}: {_describe(e)}"
    sent = broadcast_object(sent, root_rank, name="broadcast_optimizer_state")
    if isinstance(sent, str):
        if failure is not None and not isinstance(failure, ValueError):
            raise failure
        raise ValueError(sent) from failure
    # Every rank learns whether every rank took the layout before any tensor is broadcast
    # (a rank that raised alone would leave the others waiting for its broadcasts).
    problem, cause = None, None
    if not is_root:
        try:
            layout = loads(sent)
            _apply_layout(optimizer, params, layout)
        except Exception as e:
            problem, cause = _describe(e), e
    problems = allgather_object(problem, name="broadcast_optimizer_state.check")
    failed = [r for r, text in enumerate(problems) if text is not None]
    if failed:
        raise ValueError(f"broadcast_optimizer_state failed on rank(s) {failed}: "
                         f"{problems[failed[0]]}") from cause
    named, occurrences = [], {}
    for i in sorted(layout["state"]):
        st = optimizer.state[params[i]]
        for k, item in layout["state"][i].items():
            if item[0] != "tensor":
                continue
            occurrences[k] = occurrences.get(k, 0) + 1
            named.append((f"{k}.{occurrences[k]}", st[k]))
    _broadcast_tensors(named, root_rank)
