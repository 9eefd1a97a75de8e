"""`DistributedOptimizer`: averages gradients across ranks while backward is still running.

Each parameter gets a `register_post_accumulate_grad_hook`; when its gradient is final for the
step (after `backward_passes_per_step` passes), its reduction starts, so communication overlaps
the rest of backward. `step()` waits for them (`synchronize()`), then runs the wrapped
optimizer's own step. How gradients are reduced (buckets, groups or one allreduce each,
compression) is `_reducer.GradientReducer`'s job; this module is the public wrapper.

Wrapping: the returned object's class is an explicit subclass of the optimizer's class with
`_DistributedOptimizer` mixed in front (one class per optimizer class, created once and cached),
so `isinstance(opt, torch.optim.SGD)` holds and every method reaches the base class through
ordinary `super()`; user subclasses of it work too. The instance shares the wrapped optimizer's
`param_groups`, `state` and hooks, and is not re-initialised.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any, Iterator

import torch

import collective
from collective import ProcessSet, ReduceOp, adapter, global_process_set

from .._common import check_named_parameters, default_parameter_name, gradient_reduction
from ._reducer import GradientReducer
from .compression import Compression, check_compressor

__all__ = ["DistributedOptimizer", "_DistributedOptimizer"]

_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before "
                   "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                   "cause a race condition.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")


def _remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin placed before a torch optimizer class; see the module docstring.

    Constructing a subclass directly also works (`cls(params, lr=..., named_parameters=...)`):
    the Horovod options are keyword-only and the rest goes to the base optimizer.
    """

    def __init__(self, params: Any, *args: Any, named_parameters: Any = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 op: ReduceOp = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                        gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                        process_set)

    # -- setup ----------------------------------------------------------------------------------
    def _hvd_setup(self, named_parameters: Any, compression: Any, backward_passes_per_step: int,
                   op: Any, gradient_predivide_factor: float, num_groups: int, groups: Any,
                   sparse_as_dense: bool, process_set: ProcessSet) -> None:
        self._compression = check_compressor(compression)
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        op, groups = gradient_reduction(op, gradient_predivide_factor, num_groups, groups)
        _check_groups(groups)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        if op == ReduceOp.AVERAGE:
            # The runtime applies the remaining 1/size of Average after the reduction.
            self._hvd_scale = (1.0 / gradient_predivide_factor, gradient_predivide_factor)
        else:
            self._hvd_scale = (1.0, 1.0)

        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            by_id = check_named_parameters(list(named_parameters), {id(p) for p in all_params})
        else:
            by_id = {id(p): default_parameter_name(gi, pi)
                     for gi, g in enumerate(self.param_groups)
                     for pi, p in enumerate(g["params"])}
        self._parameter_names = {p: by_id[id(p)] for p in all_params}
        self._hvd_reducer = GradientReducer(self._compression, op, self._hvd_scale, process_set,
                                            sparse_as_dense, backward_passes_per_step)
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self._hvd_hooks: list[Any] = []
        ps = process_set
        included = ps is global_process_set or ps.process_set_id == 0 or bool(ps.included())
        # Elastic jobs may grow from one rank: hooks are registered at any size there.
        self._hvd_active = included and (collective.size() > 1
                                         or adapter.config().elastic)
        if self._hvd_active:
            self._hvd_register(groups)

    def _hvd_register(self, groups: Any) -> None:
        reducer = self._hvd_reducer
        seen: set[int] = set()
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    reducer.add(p, self._parameter_names[p])
        if groups is not None:
            reducer.form_groups(groups)
        else:
            reducer.form_buckets(adapter.config().bucket_cap_mb)
            if reducer.buckets:  # autotune may re-plan them between steps (_reducer.py)
                ps = self.process_set
                reducer.schedule = adapter.bucket_schedule(
                    reducer.cap_mb, ps is global_process_set or ps.process_set_id == 0,
                    owner=reducer)
        for i in range(len(reducer.slots)):
            self._hvd_hook(i)
        # A dropped optimizer takes its hooks off the parameters (they would stay on them, one
        # more at every re-wrap, each a dead call per gradient).
        weakref.finalize(self, _remove_hooks, self._hvd_hooks)

    def _hvd_hook(self, index: int) -> None:
        # Weak references only (the optimizer, and the slot by its index in the reducer): hooks
        # of a dropped optimizer must neither reduce gradients nor keep its gradient buckets
        # (as large as the gradients) alive.
        ref = weakref.ref(self)

        def hook(_p: torch.Tensor, index: int = index) -> None:
            opt = ref()
            if opt is not None:
                reducer = opt._hvd_reducer
                reducer.on_grad(reducer.slots[index])
        param = self._hvd_reducer.slots[index].param
        self._hvd_hooks.append(param.register_post_accumulate_grad_hook(hook))

    # -- public API -------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Starts the allreduce of every gradient not started yet (zeros for parameters without
        a gradient), waits for all of them and writes the averages into `p.grad`.

        Raises:
            HorovodInternalError: an allreduce failed (e.g. a rank died or shapes differ).
        """
        if not self._hvd_active:
            self._hvd_synchronized = True
            return
        self._hvd_reducer.synchronize()
        self._hvd_synchronized = True

    def _hvd_reset(self) -> None:
        self._hvd_reducer.reset()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context `step()` does not synchronize (call `synchronize()` yourself
        first, e.g. to unscale or clip the averaged gradients)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronizes (unless inside `skip_synchronize()`), then runs the optimizer's step."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    # torch's Optimizer.__init__ wraps an unmarked `step` in its profiling/hook wrapper; the base
    # class's step already runs inside that wrapper, so mark ours to avoid running hooks twice.
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Raises:
            AssertionError: gradients are still being reduced (backward ran, step did not).
        """
        if self._hvd_reducer.dirty:
            raise AssertionError(_ZERO_GRAD_RACE)
        return super().zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes accumulate locally before each allreduce.

        Raises:
            ValueError: passes <= 0.
        """
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self._hvd_reducer.passes = passes
        self._hvd_reset()

    def add_param_group(self, param_group: dict) -> None:
        """Adds a parameter group; its parameters' gradients are averaged too (each with its
        own allreduce, named `allreduce.noname.<group>.<index>`; they join no bucket, since
        buckets must match across ranks and were planned at wrap time). Every rank must add
        the same groups in the same order."""
        super().add_param_group(param_group)
        if not getattr(self, "_hvd_active", False):  # during construction, or a single rank
            return
        gi = len(self.param_groups) - 1
        reducer = self._hvd_reducer
        known = {id(s.param) for s in reducer.slots}
        for pi, p in enumerate(self.param_groups[gi]["params"]):
            if not p.requires_grad or id(p) in known:
                continue
            name = self._parameter_names.get(p) or default_parameter_name(gi, pi)
            self._parameter_names[p] = name
            reducer.add(p, name)
            self._hvd_hook(len(reducer.slots) - 1)

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads the wrapped optimizer's state and forgets in-flight gradient reductions."""
        super().load_state_dict(state_dict)
        self._hvd_reset()
        self._hvd_synchronized = False


def _check_groups(groups: Any) -> None:
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or
                                        (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    if isinstance(groups, list):
        seen: set[int] = set()
        for members in groups:
            for p in members:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))


_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()  # guards _CLASSES


def _distributed_class(base: type) -> type:
    """The cached subclass `(_DistributedOptimizer, base)`, named like `base`."""
    with _CLASSES_LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            class Distributed(_DistributedOptimizer, base):  # type: ignore[misc, valid-type]
                __doc__ = (f"{base.__name__} whose gradients are averaged across ringvod ranks "
                           "(see frameworks.torch.optimizer).")
            Distributed.__name__ = base.__name__
            Distributed.__qualname__ = base.__qualname__
            cls = _CLASSES[base] = Distributed
        return cls


# Instance attributes of the wrapped optimizer that must not shadow the wrapper's methods (an LR
# scheduler built on the plain optimizer patches `step` on the instance).
_NOT_COPIED = frozenset({"step", "zero_grad", "_opt_called"})


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wraps `optimizer` so that `step()` applies gradients averaged over all ranks.

    Args:
        optimizer: any `torch.optim.Optimizer`; its param_groups and state are shared.
        named_parameters: (name, parameter) pairs, e.g. `model.named_parameters()`; names key
            the allreduces (default `allreduce.noname.<group>.<index>`).
        compression: `hvd.Compression.none`, `.fp16` or `.bf16`.
        backward_passes_per_step: backward passes accumulated locally before each allreduce.
        op: `hvd.Average` or `hvd.Sum` (`Adasum` is not supported).
        gradient_predivide_factor: Average only: scale by 1/f before and f/size after the sum.
        num_groups: deprecated alias of an int `groups`.
        groups: an int (split parameters into that many grouped allreduces) or a list of lists
            of parameters; each group is reduced atomically once all its gradients are ready.
        sparse_as_dense: densify sparse gradients instead of allgathering them.
        process_set: the ranks that average; other ranks' `step()` is a plain step.

    Returns:
        An instance of a subclass of `type(optimizer)` with the same class name.

    Raises:
        ValueError: invalid names, groups, backward_passes_per_step or factor; `optimizer` is
            already distributed.
        NotImplementedError: op=Adasum.
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain optimizer "
                         "once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    cls = _distributed_class(type(optimizer))
    opt = cls.__new__(cls)
    opt.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in _NOT_COPIED})
    opt._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
    return opt

