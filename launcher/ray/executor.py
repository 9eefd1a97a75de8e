"""`RayExecutor`: a static ringvod job whose workers are Ray actors (Horovod's `horovod.ray`).

`start()`:

1. reserves a placement group: one bundle per worker (`num_workers`, packed), or one bundle of
   `num_workers_per_host` workers per node (`num_hosts`, strictly spread); inside a placement
   group that is already current (Ray Tune), it uses that one;
2. starts one `BaseHorovodWorker` actor per worker and asks each for its node;
3. ranks the workers node by node (`plan.group_by_node`), so hosts are Ray node ids and local
   and cross ranks follow the nodes (`plan.slots_for_nodes`);
4. runs the job's authenticated rendezvous store (`collective.rendezvous.KVServer`, a fresh
   32-byte secret) here in the driver, on this node's Ray address;
5. sets each worker's environment: its rank variables, the tcp controller, the store's address
   and the secret (which travels as a method argument inside the Ray cluster, never on a
   command line), and with `use_gpu` the GPUs of its node in local-rank order, each once
   (`plan.visible_gpus`): with one GPU per worker, `torch.cuda.set_device(hvd.local_rank())`
   picks the GPU Ray gave it and NCCL sees its peers; workers of a fractional
   `gpus_per_worker` share GPUs, so their node lists fewer GPUs than it has workers.

User functions then call `hvd.init()` and form a tcp-mode job, as under `hvdrun --gloo`.

Failures: when a call fails on any worker, the executor waits briefly for the others, reports
the root cause (a lost worker before the fallout on its peers) naming the rank, its Ray node
and address, then kills every actor and removes the placement group. A lost worker raises
`WorkerLostError`; an exception in user code is re-raised with a note naming the rank.
"""
from __future__ import annotations

import numbers
import secrets
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import ray
import ray.util.client
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (PlacementGroup, get_current_placement_group,
                                      placement_group, remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from collective.errors import HorovodInternalError
from collective.rendezvous import KVServer

from .. import network
from .plan import group_by_node, interface_env, rank_env, slots_for_nodes, visible_gpus
from .worker import BaseHorovodWorker

__all__ = ["RayExecutor", "MiniSettings", "WorkerLostError", "FAILURE_GRACE_S"]

# After a first failure, how long to wait for the other workers' outcomes before choosing the
# root cause (a lost worker's peers fail at once with HorovodInternalError).
FAILURE_GRACE_S = 3.0


class WorkerLostError(RuntimeError):
    """A worker's actor died (process crash, node lost) while the job ran.

    Attributes:
        rank: the lost worker's rank.
        node_id: the Ray node it ran on.
        node_ip: that node's address.
    """

    def __init__(self, message: str, rank: int, node_id: str, node_ip: str) -> None:
        super().__init__(message)
        self.rank, self.node_id, self.node_ip = rank, node_id, node_ip

    def __reduce__(self) -> tuple:
        # Rebuilt from all four fields: the default (from `args`, the message alone) cannot
        # call __init__, so Ray could not return the error from a task or actor that drives
        # the executor (a Tune trial), and the caller got an UnserializableException instead.
        return (type(self), (str(self), self.rank, self.node_id, self.node_ip),
                self.__dict__)


@dataclass
class MiniSettings:
    """What `RayExecutor.create_settings` returns (Horovod's `MiniSettings`).

    Attributes:
        nics: network interfaces for the job's traffic; the first one carries it.
        key: the job secret (32 random bytes).
        timeout_s: how long workers may take to start.
        placement_group_timeout_s: how long to wait for the placement group's resources.
        ssh_port, ssh_identity_file, ssh_str: accepted for Horovod compatibility; no effect on
            Ray, whose workers are actors, not ssh sessions.
    """

    nics: set[str] | None = None
    verbose: int = 1
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False


@dataclass(frozen=True)
class _WorkerInfo:
    rank: int
    node_id: str
    node_ip: str
    hostname: str
    pid: int

    def where(self) -> str:
        return (f"rank {self.rank} on Ray node {self.node_id} ({self.node_ip}, host "
                f"{self.hostname}, pid {self.pid})")


def add_note(exc: BaseException, note: str) -> None:
    """`exc.add_note(note)`; on Python 3.10, which has no `add_note` (and prints no notes), the
    note is only appended to `exc.__notes__`, so the exception itself still reaches the caller."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


def _call(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
          _executable: Any) -> Any:
    return fn(*args, **kwargs)


def _count(name: str, value: Any) -> int | None:
    """A worker or host count as an int (NumPy integers too), or None.

    Raises:
        ValueError: not a positive integer (bools and floats are refused).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


def _is_fallout(exc: BaseException) -> bool:
    """A peer's failure seen through a collective: not the root cause."""
    return isinstance(exc, HorovodInternalError)


class RayExecutor:
    """Runs functions on a ringvod job of Ray actors.

    Example:
        >>> settings = RayExecutor.create_settings(timeout_s=30)
        >>> executor = RayExecutor(settings, num_workers=2, use_gpu=False)
        >>> executor.start()
        >>> def train():
        ...     import horovod.torch as hvd
        ...     hvd.init()
        ...     return hvd.rank()
        >>> executor.run(train)
        [0, 1]
        >>> executor.shutdown()

    Args:
        settings: from `create_settings` (None: defaults).
        num_workers: number of workers, placed wherever they fit (packed).
        num_hosts: number of nodes; each runs `num_workers_per_host` workers (strict spread).
            Give either this or `num_workers`.
        num_workers_per_host: workers per node with `num_hosts`.
        cpus_per_worker: CPUs each worker reserves.
        use_gpu: give each worker `gpus_per_worker` GPUs (default 1); GPU tensors use NCCL.
        gpus_per_worker: GPUs per worker (needs `use_gpu`); below 1, workers share GPUs: pick
            the device by the place of `ray.get_gpu_ids()[0]` in `CUDA_VISIBLE_DEVICES`
            (docs/ray.md) and keep the collectives on CPU tensors (NCCL needs one GPU per
            rank).
        use_current_placement_group: inside a placement group (e.g. a Ray Tune trial), place
            the workers in it instead of reserving a new one.
        min_workers, max_workers: an elastic job (instead of `num_workers`): it starts once
            `min_workers` slots exist, grows up to `max_workers` (None: every slot), and
            re-forms when Ray nodes leave or join. Slots are the alive Ray nodes' CPUs (GPUs
            with `use_gpu`) divided by what one worker needs. Only `run()` is available.
        reset_limit: the most resets of an elastic job (None: no limit).
        cooldown_range: (lo, hi) seconds a failed node stays blacklisted (None: for good).
        elastic_timeout: seconds an elastic job waits for `min_workers` slots.
        override_discovery: accepted; the Ray nodes are always the host discovery.

    Raises:
        ValueError: inconsistent arguments.
    """

    def __init__(self, settings: MiniSettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None,
                 use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None,
                 reset_limit: int | None = None,
                 cooldown_range: tuple[int, int] | None = None,
                 elastic_timeout: int = 600, override_discovery: bool = True) -> None:
        if max_workers is not None and (min_workers is None or min_workers <= 0):
            raise ValueError("max_workers is set, but min_workers is not a positive number; "
                             "give min_workers too for an elastic job")
        if min_workers is not None and num_workers is not None:
            raise ValueError("min_workers and num_workers are mutually exclusive: give "
                             "num_workers for a static job, min_workers/max_workers for an "
                             "elastic one")
        num_workers, num_hosts, num_workers_per_host, min_workers, max_workers = (
            _count(name, value) for name, value in (
                ("num_workers", num_workers), ("num_hosts", num_hosts),
                ("num_workers_per_host", num_workers_per_host), ("min_workers", min_workers),
                ("max_workers", max_workers)))
        self._elastic: dict[str, Any] | None = None
        if min_workers is not None:
            if max_workers is not None and max_workers < min_workers:
                raise ValueError(f"max_workers={max_workers} is below min_workers="
                                 f"{min_workers}")
            if not override_discovery:
                warnings.warn("override_discovery=False has no effect: the alive Ray nodes "
                              "are always the host discovery", UserWarning, stacklevel=2)
            self._elastic = {
                "min_workers": min_workers, "max_workers": max_workers,
                "reset_limit": reset_limit, "elastic_timeout": float(elastic_timeout),
                "cooldown_range": (float(cooldown_range[0]), float(cooldown_range[1]))
                if cooldown_range else None}
            num_workers = min_workers
        elif num_workers is None and num_hosts is None:
            raise ValueError("Either num_workers or num_hosts must be set.")
        elif reset_limit is not None or cooldown_range is not None or elastic_timeout != 600:
            warnings.warn("reset_limit, cooldown_range and elastic_timeout have no effect on a "
                          "static job; give min_workers for an elastic one", UserWarning,
                          stacklevel=2)
        if num_hosts is not None and (num_workers is not None or min_workers is not None):
            raise ValueError(f"num_workers={num_workers} and num_hosts={num_hosts} are "
                             f"mutually exclusive; give num_hosts with num_workers_per_host "
                             f"to place a fixed number of workers on each node")
        if cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker={cpus_per_worker} must be >= 0")
        if not cpus_per_worker and not use_gpu:  # static and elastic jobs alike
            raise ValueError("cpus_per_worker=0 without use_gpu: a worker would reserve "
                             "nothing; give cpus_per_worker > 0, or use_gpu=True")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False. use_gpu must be "
                             "True if gpus_per_worker is set.")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker <= 0:
            raise ValueError(f"gpus_per_worker={gpus_per_worker} must be > 0 with use_gpu")
        self.settings = settings if settings is not None else self.create_settings()
        self.num_workers = num_workers if num_workers is not None else (
            num_hosts * num_workers_per_host)  # type: ignore[operator]
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []
        self._info: list[_WorkerInfo] = []
        self._pg: PlacementGroup | None = None
        self._own_pg = False
        self._server: KVServer | None = None
        self._elastic_start: dict[str, Any] | None = None
        # Seconds the last start() spent reserving, starting the actors and setting up the job.
        self.timings: dict[str, float] = {}

    # --- Horovod's API ----------------------------------------------------------------------

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: int = 100,
                        nics: set[str] | None = None) -> MiniSettings:
        """Settings for a job (Horovod's `RayExecutor.create_settings`).

        Args:
            timeout_s: how long the workers may take to start.
            ssh_identity_file, ssh_str: no effect on Ray (a warning says so when given).
            placement_group_timeout_s: how long to wait for the placement group.
            nics: network interfaces for the job; the first carries its traffic.
        """
        if ssh_identity_file is not None or ssh_str is not None:
            warnings.warn("ssh_identity_file/ssh_str have no effect on Ray: its workers are "
                          "actors started by Ray, not over ssh", UserWarning, stacklevel=2)
        return MiniSettings(nics=set(nics) if nics else None, ssh_identity_file=ssh_identity_file,
                            ssh_str=ssh_str, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s)

    def start(self, executable_cls: type | None = None,
              executable_args: list[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: dict[str, Any] | None = None) -> None:
        """Starts the workers and sets up the job (see the module docstring).

        Args:
            executable_cls: a class built once in each worker; `execute(fn)` calls
                `fn(instance)`.
            executable_args, executable_kwargs: its constructor arguments.
            extra_env_vars: variables set in every worker before anything else runs there.

        Raises:
            RuntimeError: already started.
            TimeoutError: the placement group or the workers were not ready in time.
            ValueError: a named network interface has no address here, or a worker would
                reserve nothing (cpus_per_worker=0 without use_gpu).
        """
        if self.workers or self._elastic_start is not None:
            raise RuntimeError("this RayExecutor is already started; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        if ray.util.client.ray.is_connected():
            raise NotImplementedError(
                "RayExecutor does not run through Ray Client (ray://): the job's rendezvous "
                "store lives in the driver, which the workers must reach. Run the driver on "
                "the cluster instead (e.g. `ray job submit`)")
        if self._elastic is not None:  # workers start with each run(), round by round
            if executable_cls is not None:
                warnings.warn("executable_cls has no effect on an elastic job (its workers "
                              "come and go; use run())", UserWarning, stacklevel=2)
            self._elastic_start = {"env": {str(k): str(v) for k, v in
                                           (extra_env_vars or {}).items()}}
            return
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        except BaseException:
            self.shutdown()
            raise

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: dict[str, Any] | None = None,
            callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """Runs `fn(*args, **kwargs)` on every worker and returns the results by rank.

        Raises:
            WorkerLostError: a worker died; the job was stopped.
            Exception: `fn` raised on some rank (with a note naming it); the job was stopped.
        """
        self._warn_callbacks(callbacks)
        if self._elastic is not None:
            return self._run_elastic(fn, args, kwargs)
        return self._gather(self.run_remote(fn, args, kwargs))

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Starts `fn(*args, **kwargs)` on every worker; returns their `ObjectRef`s by rank
        (failures then surface from `ray.get`, and do not stop the job)."""
        self._check_started()
        call = partial(_call, fn, tuple(args or ()), dict(kwargs or {}))
        return [w.execute.remote(call) for w in self.workers]

    def execute(self, fn: Callable[[Any], Any],
                callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """Runs `fn(executable)` on every worker (the object built by `start`); results by
        rank."""
        self._warn_callbacks(callbacks)
        self._check_started()
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(executable)` on rank 0 only and returns its result."""
        self._check_started()
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def shutdown(self) -> None:
        """Kills every worker actor, removes the placement group this executor reserved and
        stops the rendezvous store. Safe to call twice, and after `ray.shutdown()`;
        `start()` may follow."""
        self._elastic_start = None
        workers, self.workers, self._info = self.workers, [], []
        pg = self._pg if self._own_pg else None
        # After ray.shutdown(), the actors and the placement group went with this driver's
        # job; ray.kill() would only start a new local Ray instance (it initializes Ray).
        if ray.is_initialized():
            for w in workers:
                try:
                    ray.kill(w, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead, or Ray is shutting down
                    pass
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass
        self._pg, self._own_pg = None, False
        if self._server is not None:
            self._server.stop()
            self._server = None

    # --- ringvod additions ------------------------------------------------------------------

    @property
    def worker_info(self) -> list[_WorkerInfo]:
        """Where each rank runs (node id, node IP, hostname, pid), by rank."""
        return list(self._info)

    # --- internals --------------------------------------------------------------------------

    def _start(self, executable_cls: type | None, executable_args: list[Any] | None,
               executable_kwargs: dict[str, Any] | None,
               extra_env_vars: dict[str, Any] | None) -> None:
        s = self.settings
        t0 = time.perf_counter()
        bundle_of = self._reserve()
        t1 = time.perf_counter()
        gpus = self.gpus_per_worker
        actor_cls = ray.remote(BaseHorovodWorker)
        actors = []
        for i in range(self.num_workers):
            # Tasks the workers start are not captured into the group (Horovod's choice too):
            # inside a Tune trial they would otherwise inherit the trial's capture and wait
            # for room in a group the workers already fill.
            strategy = PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=bundle_of(i),
                placement_group_capture_child_tasks=False)
            actors.append(actor_cls.options(num_cpus=self.cpus_per_worker, num_gpus=gpus,
                                            scheduling_strategy=strategy)
                          .remote(world_rank=i, world_size=self.num_workers))
        self.workers = actors  # so that a failure below kills them
        try:
            placements = ray.get([a.placement.remote() for a in actors], timeout=s.timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"Timed out waiting for {self.num_workers} Ray workers to start "
                f"({s.timeout_s} s). Raise timeout_s in create_settings() if the cluster is "
                f"slow to start processes.") from None
        t2 = time.perf_counter()
        order = group_by_node([p[0] for p in placements])
        self.workers = [actors[i] for i in order]
        placements = [placements[i] for i in order]
        slots = slots_for_nodes([p[0] for p in placements])
        self._info = [_WorkerInfo(r, p[0], p[1], p[2], p[3]) for r, p in enumerate(placements)]

        host, _ = self._server_host()
        self._server = KVServer(host, 0, s.key)
        rendezvous = self._server.start()

        visible = visible_gpus([p[0] for p in placements], [p[4] for p in placements])
        envs = []
        for slot in slots:
            env = rank_env(slot, rendezvous, s.key.hex(), extra_env_vars)
            interface_env(s.nics, env)
            if self.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = visible[slot.rank]
            envs.append(env)
        ray.get([w.update_env_vars.remote(e) for w, e in zip(self.workers, envs)],
                timeout=s.timeout_s)
        self._gather([w.start_executable.remote(executable_cls, executable_args,
                                                executable_kwargs) for w in self.workers])
        self.timings = {"placement_group_s": t1 - t0, "actors_s": t2 - t1,
                        "setup_s": time.perf_counter() - t2}

    def _reserve(self) -> Callable[[int], int]:
        """Reserves (or adopts) the placement group; returns worker index -> bundle index."""
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            self._pg, self._own_pg = current, False
            return lambda i: -1
        unit = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            unit["GPU"] = self.gpus_per_worker
        if not any(unit.values()):  # Ray refuses an empty bundle with a text of its own
            raise ValueError("cpus_per_worker=0 without use_gpu: a worker would reserve "
                             "nothing; give cpus_per_worker > 0, or use_gpu=True")
        if self.num_hosts is not None:
            per = self.num_workers_per_host
            bundles = [{k: v * per for k, v in unit.items()} for _ in range(self.num_hosts)]
            strategy = "STRICT_SPREAD"
            bundle_of = lambda i: i // per  # noqa: E731
        else:
            bundles = [dict(unit) for _ in range(self.num_workers)]
            strategy = "PACK"
            bundle_of = lambda i: i  # noqa: E731
        self._pg, self._own_pg = placement_group(bundles, strategy=strategy), True
        timeout = self.settings.placement_group_timeout_s
        try:
            ray.get(self._pg.ready(), timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(
                f"Placement group creation timed out after {timeout} s: it needs {bundles} "
                f"({strategy}), and the cluster has {ray.available_resources()} available. "
                f"Make sure your cluster either has enough resources or use an autoscaling "
                f"cluster; raise placement_group_timeout_s to wait longer.") from None
        return bundle_of

    def _server_host(self) -> tuple[str, str | None]:
        """(address for the rendezvous store, the interface named in `nics` or None)."""
        nics = self.settings.nics
        iface = sorted(nics)[0] if nics else None
        if iface is None:
            return ray.util.get_node_ip_address(), None
        host = network.interface_address(iface)
        if host is None:
            raise ValueError(f"network interface {iface!r} (nics) has no IPv4 address on "
                             f"the driver's host; interfaces here: "
                             f"{', '.join(network.interface_names())}")
        return host, iface

    def _run_elastic(self, fn: Callable[..., Any], args: Sequence[Any] | None,
                     kwargs: dict[str, Any] | None) -> list[Any]:
        from .elastic import run_elastic  # noqa: PLC0415
        if self._elastic_start is None:
            raise RuntimeError("the RayExecutor is not started; call start() first")
        e = self._elastic
        assert e is not None
        host, _ = self._server_host()
        env = dict(self._elastic_start["env"])
        interface_env(self.settings.nics, env)
        return run_elastic(fn, tuple(args or ()), dict(kwargs or {}), secret=self.settings.key,
                           server_host=host, min_workers=e["min_workers"],
                           max_workers=e["max_workers"], cpus_per_worker=self.cpus_per_worker,
                           gpus_per_worker=self.gpus_per_worker, use_gpu=self.use_gpu,
                           reset_limit=e["reset_limit"], cooldown_range=e["cooldown_range"],
                           elastic_timeout=e["elastic_timeout"], env=env)

    def _check_started(self) -> None:
        if self._elastic is not None:
            raise NotImplementedError("an elastic RayExecutor (min_workers=...) runs functions "
                                      "with run() only: its workers change from round to round")
        if not self.workers:
            raise RuntimeError("the RayExecutor is not started (or was shut down after a "
                               "failure); call start() first")

    @staticmethod
    def _warn_callbacks(callbacks: list[Callable[..., Any]] | None) -> None:
        if callbacks:
            warnings.warn("callbacks have no effect: ringvod returns the workers' results "
                          "instead of passing values logged by rank 0 to callbacks",
                          UserWarning, stacklevel=3)

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Results by position; on the first failure, stops the job and raises its root cause."""
        results: list[Any] = [None] * len(refs)
        pending = {ref: i for i, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001
                    self._fail(i, exc, pending)
        return results

    def _fail(self, first: int, exc: Exception, pending: dict[Any, int]) -> None:
        failures = [(first, exc)]
        if pending and not isinstance(exc, RayActorError):
            ready, _ = ray.wait(list(pending), num_returns=len(pending),
                                timeout=FAILURE_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as other:  # noqa: BLE001
                    failures.append((pending[ref], other))
        lost = [f for f in failures if isinstance(f[1], RayActorError)]
        real = [f for f in failures if not _is_fallout(f[1])]
        rank, cause = (lost or real or failures)[0]
        info = self._info[rank] if rank < len(self._info) else None
        self.shutdown()
        where = info.where() if info else f"worker {rank}"
        if isinstance(cause, RayActorError):
            text = str(cause).strip().splitlines()
            why = (text[0] if text else type(cause).__name__).rstrip(".")
            raise WorkerLostError(
                f"ringvod on Ray: the worker of {where} was lost: "
                f"{why}. The job was stopped and its "
                f"actors removed; call start() to run again.",
                rank, info.node_id if info else "", info.node_ip if info else "") from cause
        if isinstance(cause, RayTaskError):
            add_note(cause, f"ringvod on Ray: raised on {where}; the job was stopped and its "
                            f"actors removed")
        raise cause
