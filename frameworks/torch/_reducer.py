"""`GradientReducer`: how `DistributedOptimizer` reduces its gradients across ranks.

Every parameter with `requires_grad` gets a `_Slot`. When its gradient is final for the step
(after `passes` backward passes, counted by the optimizer's hooks through `on_grad`), it is
reduced in one of three ways, decided once at wrap time:

* **bucket** (the default, `HOROVOD_BUCKET_CAP_MB` > 0): the last gradient of a ~25 MB bucket
  packs the bucket into one flat buffer and enqueues one allreduce (`_buckets.Bucket`);
* **group** (`groups=`): the last gradient of a group enqueues one grouped allreduce of all of
  its members;
* **per gradient** (`HOROVOD_BUCKET_CAP_MB=0`): one in-place allreduce per gradient, fused by
  the coordinator with whatever else is ready on every rank (Horovod's mode). The parameters of
  wrap time form a *gradient set* (`collective.adapter.gradient_set`, registered on first use
  with every rank and again after a re-`init()`): a hook hands its gradient to the set, and
  `synchronize()` waits for the whole set once, instead of one request, handle and wait per
  gradient. Parameters added later, sparse gradients (their own allgather; zeros in the set)
  and jobs that cannot run a set (dynamic process sets, parameters on several devices) take
  one ordinary op per gradient.

Compression applies to what is sent in every mode. `synchronize()` starts whatever has not
started (zeros for parameters without a gradient, so no rank hangs), waits for everything and
writes the results into `p.grad`.

Autotune (`HOROVOD_AUTOTUNE=1`) may change the bucket size while training runs. The optimizer
then holds a bucket schedule (`schedule`, from `collective.adapter.bucket_schedule`): at the end
of every `synchronize()`, after the reductions have all completed and the step's state is reset,
the reducer counts the step in it (`step_done()`) and, when the size in force for the next step
differs, re-plans the buckets of the parameters it bucketed at wrap time (`_replan`). Nothing
is in flight then, and every rank re-plans after the same `synchronize()` call (the schedule
decides by the count of completed calls, collective/coordinator/tuning.py), so the bucket names
of every later step match across ranks. Parameters added later (`add_param_group`) stay in
per-gradient mode; with `groups=` or per-gradient mode there is no schedule.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

import collective
from collective import ProcessSet, ReduceOp, RequestType, adapter, global_process_set
from collective.errors import MismatchError

from .._common import split_list
from ._buckets import Bucket, plan_buckets
from . import _cuda
from ._buffers import CPU_DEVICE, dtype_of, engine_view, enqueue
from .functions import broadcast_object
from .ops import sparse_allreduce_async

__all__ = ["GradientReducer", "TOO_MANY_PASSES"]

TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                   "call to step(). Increase backward_passes_per_step to accumulate gradients "
                   "locally.")


class _Slot:
    """One parameter's gradient and its in-flight allreduce."""

    __slots__ = ("param", "name", "delay", "handle", "send", "cctx", "sparse", "group", "bucket",
                 "member", "queued")

    def __init__(self, param: torch.Tensor, name: str, delay: int) -> None:
        self.param = param
        self.name = name
        self.delay = delay  # backward passes left before this step's allreduce starts
        self.handle: Any = None  # Handle, or a callable for sparse gradients
        self.send: torch.Tensor | None = None  # the tensor being reduced in place
        self.cctx: Any = None  # compression context
        self.sparse = False  # the gradient was sparse and went through sparse_as_dense
        self.group: _Group | None = None
        self.bucket: Bucket | None = None
        self.member = -1  # index in the reducer's gradient set (-1: not a member)
        self.queued = False  # handed to the gradient set this step


class _Group:
    """Parameters whose gradients are reduced as one grouped allreduce."""

    __slots__ = ("slots", "name", "ready", "handle")

    def __init__(self, slots: list[_Slot], name: str) -> None:
        self.slots = slots
        self.name = name
        self.ready = 0  # members whose hook has fired this step
        self.handle: Any = None


class GradientReducer:
    """The gradient reductions of one optimizer (see the module docstring).

    Args:
        compression: a checked compressor (`compression.check_compressor`).
        op: Average or Sum.
        scale: (prescale, postscale) factors of every allreduce.
        process_set: the ranks that reduce.
        sparse_as_dense: densify sparse gradients instead of allgathering them.
        passes: backward passes accumulated locally before each reduction.
    """

    def __init__(self, compression: Any, op: ReduceOp, scale: tuple[float, float],
                 process_set: ProcessSet, sparse_as_dense: bool, passes: int) -> None:
        self.compression = compression
        self.op = op
        self.scale = scale
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        self.passes = passes
        self.lock = threading.Lock()  # guards group counters (hooks may run on any thread)
        self.dirty = False  # a hook fired since the last synchronize
        self.slots: list[_Slot] = []
        self.groups: list[_Group] = []
        self.buckets: list[Bucket] = []
        self.cap_mb = 0.0  # the bucket size of the current plan (0: no buckets)
        self._bucketed: list[_Slot] = []  # the slots the buckets cover (those at wrap time)
        self.schedule: Any = None  # autotune's bucket schedule (see the module docstring)
        self.members: list[_Slot] = []  # the gradient set's slots, in member order
        self.gset: Any = None  # the registered set (None: not registered with this runtime)
        self._ordinary = False  # this step's members go through ordinary ops (`_live_set`)
        self._expect: list[tuple[torch.dtype, int]] = []  # per member: dtype and size sent

    # -- setup ----------------------------------------------------------------------------------
    def add(self, param: torch.Tensor, name: str) -> _Slot:
        slot = _Slot(param, name, self.passes)
        self.slots.append(slot)
        return slot

    def form_groups(self, groups: Any) -> None:
        # Every rank must form the same groups: order parameters as the set's first rank does.
        slots = self.slots
        root = 0 if self.process_set is global_process_set else self.process_set.ranks[0]
        order = broadcast_object([s.name for s in slots], root_rank=root,
                                 name="DistributedOptimizer.groups",
                                 process_set=self.process_set)
        pos = {n: i for i, n in enumerate(order)}
        slots = sorted(slots, key=lambda s: pos.get(s.name, len(pos)))
        if isinstance(groups, int):
            chunks = split_list(slots, groups)
        else:
            by_id = {id(s.param): s for s in slots}
            chunks, used = [], set()
            for members in groups:
                chunk = [by_id[id(p)] for p in members if id(p) in by_id]
                used.update(id(s.param) for s in chunk)
                if chunk:
                    chunks.append(chunk)
            chunks += [[s] for s in slots if id(s.param) not in used]
        for chunk in chunks:
            if len(chunk) < 2:
                continue
            group = _Group(chunk, chunk[0].name)
            for s in chunk:
                s.group = group
            self.groups.append(group)

    def form_buckets(self, cap_mb: float) -> None:
        """Buckets of `cap_mb` MB; per-gradient mode (a gradient set) when `cap_mb` <= 0."""
        if not self.slots:
            return
        if cap_mb <= 0:
            if len({s.param.device for s in self.slots}) == 1:
                self.members = list(self.slots)
                for i, s in enumerate(self.members):
                    s.member = i
            return
        self._bucketed = list(self.slots)
        self._plan(cap_mb)

    def _plan(self, cap_mb: float) -> None:
        self.cap_mb = cap_mb
        slots = self._bucketed
        plan = plan_buckets([s.param for s in slots], [s.name for s in slots],
                            int(cap_mb * 1024 * 1024))
        for indices, name in plan:
            bucket = Bucket([slots[i].param for i in indices], name, len(self.buckets),
                            [slots[i].name for i in indices])
            for i in indices:
                slots[i].bucket = bucket
            self.buckets.append(bucket)

    def _replan(self, cap_mb: float) -> None:
        """New buckets of `cap_mb` MB over the same parameters (between steps: nothing is in
        flight)."""
        for slot in self._bucketed:
            slot.bucket = None
        self.buckets = []
        self._plan(cap_mb)

    # -- per-gradient path (hooks) ----------------------------------------------------------------
    def on_grad(self, slot: _Slot) -> None:
        # Runs once per parameter per backward pass on the autograd thread, holding the GIL
        # while backward's kernels wait to be launched: keep it short (bucket packing checks
        # the gradients once per bucket).
        if slot.delay <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self.dirty = True
        slot.delay -= 1
        if slot.delay:
            return
        if slot.member >= 0:
            self._submit(slot)
            return
        bucket = slot.bucket
        if bucket is not None:
            grad = slot.param.grad
            if grad is not None and grad.is_sparse and not self.sparse_as_dense:
                # Its own (sparse) reduction; zeros in the bucket. With sparse_as_dense it is
                # densified into the bucket, so that a rank without this gradient (zeros in
                # its bucket) still takes part in the same op.
                self._launch(slot)
            if bucket.mark_ready():
                self._launch_bucket(bucket)
            return
        grad = slot.param.grad
        if grad is not None and grad.requires_grad:
            raise AssertionError("DistributedOptimizer does not support gradients that require "
                                 "grad (backward(create_graph=True))")
        group = slot.group
        if group is None:
            self._launch(slot)
            return
        with self.lock:
            group.ready += 1
            complete = group.ready == len(group.slots)
        if complete:
            self._launch_group(group)

    # -- gradient set -----------------------------------------------------------------------------
    def _live_set(self) -> Any:
        """The gradient set, registered with the running job if it is not (collective: every
        rank gets here at its first gradient, or first synchronize, after `init()` or a reset).
        None when this step's gradients go through ordinary ops instead (`_ordinary`): a rank
        has joined, so the registration cannot complete now (a later step registers), or the
        job cannot run a set at all (dynamic process sets: then never again).

        Raises:
            NotInitializedError / ShutdownError: no running job.
            HorovodInternalError / ShutdownError: this step's set failed on this rank (its
                `synchronize()` raises the same; a reset or the next step starts afresh).
            ValueError: the ranks' parameters differ (`collective.gradset.MISMATCH`).
        """
        gs = self.gset
        if gs is not None and gs.error is None:
            return gs
        if gs is not None and gs.partial() and gs.current():
            raise gs.error  # never a new set in the middle of a step that failed
        self.gset = None
        members = self.members
        sent: dict[torch.dtype, torch.dtype] = {}  # parameter dtype -> the dtype sent
        for s in members:
            if s.param.dtype not in sent:
                probe = torch.zeros(1, dtype=s.param.dtype, device=s.param.device)
                sent[s.param.dtype] = self.compression.compress(probe)[0].dtype
        self._expect = [(sent[s.param.dtype], s.param.numel()) for s in members]
        device = members[0].param.device
        pre, post = self.scale
        try:
            gs = adapter.gradient_set(
                [f"allreduce.{s.name}" for s in members],
                [tuple(s.param.shape) for s in members],
                [dtype_of(torch.empty(0, dtype=sent[s.param.dtype])) for s in members],
                device.index if device.type == "cuda" else CPU_DEVICE, self.process_set,
                self.op, pre, post, _cuda.allocate if device.type == "cuda" else None)
        except MismatchError:
            # The registration's allgather is refused while a rank is joined: this step's
            # gradients go through ordinary ops (joined ranks contribute zeros to those).
            self._ordinary = True
            return None
        if gs is None:
            for s in members:
                s.member = -1
            self.members = []
            self._ordinary = True
            return None
        for s in members:
            s.queued = False  # nothing of this step is in the new set yet
        self.gset = gs
        # An optimizer dropped by the program takes its set out of the rounds (once every rank
        # dropped it), instead of adding its words to every later round.
        weakref.finalize(self, gs.retire)
        return gs

    def _submit(self, slot: _Slot) -> None:
        """Hands a member's final gradient (zeros if it has none) to the gradient set."""
        gs = self.gset
        if not self._ordinary and (gs is None or gs.error is not None):
            gs = self._live_set()  # once per step at most: it sets _ordinary when it fails
        if gs is None or self._ordinary:
            self._launch(slot)
            slot.queued = True
            return
        p = slot.param
        grad = p.grad
        if grad is not None and grad.requires_grad:
            raise AssertionError("DistributedOptimizer does not support gradients that require "
                                 "grad (backward(create_graph=True))")
        if grad is not None and grad.is_sparse and not self.sparse_as_dense:
            self._launch(slot)  # its own (sparse) reduction; zeros in the set
            send = self.compression.compress(torch.zeros(p.shape, dtype=p.dtype,
                                                         device=p.device))[0]
        else:
            send = self._prepare(slot)
        i = slot.member
        dtype, numel = self._expect[i]
        if send.dtype != dtype or send.numel() != numel:
            raise ValueError(f"the gradient of {slot.name!r} ({send.dtype}, {send.numel()} "
                             f"elements to send) does not match its parameter ({dtype}, "
                             f"{numel} elements)")
        gs.submit(i, *engine_view(send))
        slot.queued = True

    def _launch_bucket(self, bucket: Bucket) -> None:
        flat = bucket.pack(self.sparse_as_dense)
        send, bucket.cctx = self.compression.compress(flat)
        bucket.send = send
        pre, post = self.scale
        bucket.handle = enqueue(RequestType.ALLREDUCE, [send], outputs=[send], name=bucket.name,
                                process_set=self.process_set, op=self.op, prescale=pre,
                                postscale=post, layout=bucket.layout)

    def _prepare(self, slot: _Slot) -> torch.Tensor | None:
        """Returns the dense tensor to reduce in place (None: launched as sparse)."""
        p = slot.param
        if p.grad is None:
            # Another rank may have a gradient for it: contribute zeros rather than hang.
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        grad = p.grad
        slot.sparse = False
        if grad.is_sparse:
            if not self.sparse_as_dense and slot.group is None:
                return None
            grad, slot.sparse = grad.to_dense(), True
        send, slot.cctx = self.compression.compress(grad)
        if not send.is_contiguous():
            send = send.contiguous()
        slot.send = send
        return send

    def _launch(self, slot: _Slot) -> None:
        send = self._prepare(slot)
        if send is None:
            slot.handle = sparse_allreduce_async(slot.param.grad, slot.name, self.op,
                                                 self.process_set)
            return
        pre, post = self.scale
        slot.handle = enqueue(RequestType.ALLREDUCE, [send], outputs=[send], name=slot.name,
                              process_set=self.process_set, op=self.op, prescale=pre,
                              postscale=post)

    def _launch_group(self, group: _Group) -> None:
        sends = [self._prepare(s) for s in group.slots]
        pre, post = self.scale
        group.handle = enqueue(RequestType.ALLREDUCE, sends, outputs=sends, name=group.name,
                               process_set=self.process_set, op=self.op, prescale=pre,
                               postscale=post, grouped=True)

    def _write_back(self, slot: _Slot, sparse_result: Any = None) -> None:
        p = slot.param
        if sparse_result is not None:
            p.grad = sparse_result
            return
        send = slot.send
        assert send is not None
        out = self.compression.decompress(send, slot.cctx)
        if slot.sparse:
            p.grad = out.to_sparse()
        elif out is not p.grad:
            p.grad.copy_(out)

    # -- step -----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Starts every reduction not started yet, waits for all of them and writes the results
        into `p.grad`; the next step starts afresh whatever happens (after a failure, autotune
        no longer changes the bucket size).

        Raises:
            HorovodInternalError: an allreduce failed (e.g. a rank died or shapes differ).
        """
        try:
            if self.members:
                self._finish_set()
            in_set = not self._ordinary
            for slot in self.slots:
                if slot.member >= 0 and in_set:
                    continue
                if slot.handle is not None or slot.group is not None:
                    continue
                if slot.bucket is None:
                    self._launch(slot)
                elif slot.delay > 0 and not self.sparse_as_dense:
                    # A sparse gradient whose hook did not finish counting (a step after fewer
                    # than backward_passes_per_step passes, a gradient set by hand): its own
                    # reduction, as its hook would have started it (zeros in the bucket).
                    grad = slot.param.grad
                    if grad is not None and grad.is_sparse:
                        self._launch(slot)
            for bucket in self.buckets:
                if bucket.handle is None:
                    self._launch_bucket(bucket)
            for group in self.groups:
                if group.handle is None:
                    self._launch_group(group)
            for bucket in self.buckets:
                assert bucket.send is not None
                try:
                    bucket.handle.wait()
                except MismatchError as exc:
                    raise MismatchError(
                        f"{exc} DistributedOptimizer's gradient bucket {bucket.name!r} on rank "
                        f"{collective.rank()} holds {bucket.describe()}; every rank must "
                        "wrap the same model's parameters, in the same order.") from None
                bucket.unpack(self.compression.decompress(bucket.send, bucket.cctx),
                              self.sparse_as_dense)
            for slot in self.slots:
                if (slot.member >= 0 and in_set) or slot.group is not None or (
                        slot.bucket is not None and slot.handle is None):
                    continue
                if isinstance(slot.handle, collective.Handle):
                    slot.handle.wait()
                    self._write_back(slot)
                else:  # sparse: a function that waits and builds the summed tensor
                    self._write_back(slot, slot.handle())
            for group in self.groups:
                group.handle.wait()
                for slot in group.slots:
                    self._write_back(slot)
        except BaseException:
            self.reset()
            if self.schedule is not None:
                # Ranks may disagree on whether this step completed: stop tuning the bucket
                # size rather than count a step some ranks may not count.
                self.schedule.close()
                self.schedule = None
            raise
        self.reset()
        if self.schedule is not None:  # autotune: the bucket size of the next step
            cap = self.schedule.step_done()
            if cap != self.cap_mb:
                self._replan(cap)

    def _finish_set(self) -> None:
        """The gradient set's part of `synchronize`: submits the members not submitted yet,
        waits for all of them and writes the results back."""
        for slot in list(self.members):
            if not slot.queued:
                self._submit(slot)
        if self._ordinary:  # this step went through ordinary ops (_live_set)
            return
        done = self.gset.wait()
        if done is not None and self.members[0].param.is_cuda:
            _cuda.settle(done)  # the current stream waits for the set's last op
        for slot in self.members:
            if slot.handle is not None:  # sparse: a function that waits and sums
                self._write_back(slot, slot.handle())
            else:
                self._write_back(slot)

    def reset(self) -> None:
        """Forgets in-flight reductions and restarts the pass count."""
        gs = self.gset
        if gs is not None and gs.partial():
            # Reset mid-step (not after a completed synchronize): members of this step are in
            # flight. The set is retired (it takes no part in later rounds' agreements) and a
            # new one registers on first use.
            gs.retire()
            self.gset = None
        self._ordinary = False
        for slot in self.slots:
            slot.delay = self.passes
            slot.queued = False
            slot.handle = slot.send = slot.cctx = None
        for group in self.groups:
            group.ready = 0
            group.handle = None
        for bucket in self.buckets:
            bucket.reset()
        self.dirty = False
