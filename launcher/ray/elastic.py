"""Elastic jobs on Ray: `RayExecutor(min_workers=...)` and the deprecated `ElasticRayExecutor`.

The elastic driver of `hvdrun --min-np` (`launcher.elastic.ElasticDriver`) does the work; Ray
provides two of its plug-ins:

* `RayHostDiscovery`: the alive Ray nodes are the hosts (keyed by node id), each with as many
  slots as its CPUs (or GPUs, with `use_gpu`) hold workers; a node that leaves the cluster
  disappears from it, a node that joins appears (the driver polls it every second);
* `RaySpawner`: starts each worker as a `BaseHorovodWorker` actor pinned to its node, sets its
  environment and runs the function in it; an actor that dies (its node left) is reported to
  the driver as a failed worker, which blacklists the node and re-forms the job.

The function normally wraps its training loop in `hvd.elastic.run` with a state object, exactly
as under `hvdrun --min-np`; the results are those of the last round's ranks.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .worker import BaseHorovodWorker

__all__ = ["RayHostDiscovery", "RaySpawner", "ElasticRayExecutor", "ElasticSettings",
           "run_elastic"]

_EXIT, _OK = "exit", "ok"


class RayHostDiscovery:
    """`{node id: slots}` of the alive Ray nodes (the elastic driver's host discovery).

    Args:
        use_gpu: count slots by GPUs (a node without GPUs has none).
        cpus_per_slot, gpus_per_slot: what one worker needs.
    """

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float = 1) -> None:
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus_per_slot

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts: dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            slots = int(res.get("CPU", 0) // self.cpus_per_slot) if self.cpus_per_slot else 1 << 30
            if self.use_gpu:
                slots = min(slots, int(res.get("GPU", 0) // self.gpus_per_slot))
            if slots > 0:
                hosts[node["NodeID"]] = slots
        return hosts


def _elastic_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                  _executable: Any) -> tuple:
    """Runs the job's function in a worker; a SystemExit (the driver removed this worker or
    stopped the job) becomes a value, since it would end a Ray actor."""
    try:
        value = fn(*args, **kwargs)
    except SystemExit as exc:
        return (_EXIT, exc.code)
    return (_OK, int(os.environ.get("HOROVOD_RANK", "-1")), value)


class RaySpawner:
    """Starts elastic workers as Ray actors (`launcher.elastic.spawn.WorkerSpawner`).

    Args:
        fn, args, kwargs: what every worker runs.
        cpus_per_worker, gpus_per_worker: each actor's reservation.
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *,
                 cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 message: Callable[[str], None] | None = None) -> None:
        self._call = (fn, tuple(args), dict(kwargs))
        self.cpus, self.gpus = cpus_per_worker, gpus_per_worker
        self._message = message or (lambda text: None)
        self._lock = threading.Lock()
        self._actors: dict[int, Any] = {}
        self._stopped: set[int] = set()  # workers whose actors the driver (or `close`) ended
        self._threads: list[threading.Thread] = []
        self.results: dict[int, tuple[int, Any]] = {}  # worker id -> (last rank, value)
        # worker id -> what went wrong, a text that follows "worker <id>: "
        self.errors: dict[int, str] = {}

    def spawn(self, worker_id: int, hostname: str, env: dict[str, str],
              on_exit: Callable[[int, int, str | None], None]) -> None:
        from functools import partial  # noqa: PLC0415
        actor = ray.remote(BaseHorovodWorker).options(
            num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(hostname, soft=False),
        ).remote()
        with self._lock:
            self._actors[worker_id] = actor
        actor.update_env_vars.remote(env)  # actor calls run in order: before the function
        ref = actor.execute.remote(partial(_elastic_call, *self._call))
        t = threading.Thread(target=self._wait, args=(worker_id, hostname, ref, on_exit),
                             name=f"hvd-ray-worker{worker_id}-wait", daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _wait(self, wid: int, node: str, ref: Any,
              on_exit: Callable[[int, int, str | None], None]) -> None:
        try:
            out = ray.get(ref)
        except RayActorError as exc:
            with self._lock:
                stopped = wid in self._stopped
            if stopped:  # the driver's own doing: it has said why, Ray's text would mislead
                self.errors[wid] = f"its actor on Ray node {node} was ended by the elastic driver"
            else:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                self.errors[wid] = f"its actor on Ray node {node} was lost: {first}"
                self._message(f"ringvod on Ray: worker {wid}: {self.errors[wid]}")
            on_exit(wid, 1, None)
            return
        except Exception as exc:  # noqa: BLE001 - the function raised
            # The worker ends here, as its process would under `hvdrun`: the actor outlives
            # its task, and its runtime (still a member of the job, still answering
            # negotiation) would keep its peers waiting in their collectives forever instead
            # of failing them over to the next round.
            self.stop(wid, 0)
            self.errors[wid] = "".join(traceback.format_exception_only(exc)).strip()
            self._message(f"ringvod on Ray: worker {wid} on node {node} failed:\n"
                          f"{self.errors[wid]}")
            on_exit(wid, 1, None)
            return
        # The function returned: the actor stays until the job's end (`close`), so that its
        # runtime's last messages reach the peers still finishing the same step.
        if out[0] == _EXIT:
            code = out[1]
            on_exit(wid, 0 if code in (None, 0) else 1, None)
            return
        self.results[wid] = (out[1], out[2])
        on_exit(wid, 0, None)

    def stop(self, worker_id: int, sig: int) -> None:
        with self._lock:
            actor = self._actors.get(worker_id)
            self._stopped.add(worker_id)
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        with self._lock:
            actors, threads = list(self._actors.values()), list(self._threads)
            self._stopped.update(self._actors)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for t in threads:
            t.join(10.0)


def run_elastic(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *,
                secret: bytes, server_host: str, min_workers: int, max_workers: int | None,
                cpus_per_worker: float, gpus_per_worker: float, use_gpu: bool,
                reset_limit: int | None, cooldown_range: tuple[float, float] | None,
                elastic_timeout: float, env: Mapping[str, str], discovery: Any = None
                ) -> list[Any]:
    """Runs one elastic job on the Ray cluster; returns the last round's results by rank.

    Raises:
        ImportError: this ringvod has no elastic driver.
        RuntimeError: the job failed (the driver's summary says why).
    """
    try:
        from ..elastic.driver import ElasticDriver, ElasticKVServer  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError("elastic jobs need ringvod's elastic driver (launcher.elastic), "
                          "which this installation lacks") from exc
    from .executor import add_note  # noqa: PLC0415
    from .plan import rank_env  # noqa: PLC0415

    def say(text: str) -> None:
        sys.stderr.write(text.rstrip("\n") + "\n")
        sys.stderr.flush()

    holder: dict[str, Any] = {}
    server = ElasticKVServer(server_host, 0, secret,
                             on_ready=lambda wid, seq: holder["driver"].ready(wid, seq))
    rendezvous = server.start()
    spawner = RaySpawner(fn, args, kwargs, cpus_per_worker=cpus_per_worker,
                         gpus_per_worker=gpus_per_worker if use_gpu else 0, message=say)
    extra = dict(env)
    extra.setdefault("HOROVOD_ELASTIC_TIMEOUT", f"{elastic_timeout:g}")
    try:
        driver = ElasticDriver(
            discovery or RayHostDiscovery(use_gpu, cpus_per_worker, gpus_per_worker or 1),
            spawner, lambda slot: rank_env(slot, rendezvous, secret.hex(), extra), server,
            num_proc=min_workers, min_np=min_workers, max_np=max_workers,
            elastic_timeout=elastic_timeout, reset_limit=reset_limit,
            cooldown_range=cooldown_range, message=say)
        holder["driver"] = driver
        result = driver.run()
    finally:
        server.stop()
    say(result.summary)
    if result.exit_code != 0:
        exc = RuntimeError(f"ringvod on Ray: elastic job failed: {result.error}\n"
                           f"{result.summary}")
        for wid in sorted(spawner.errors):  # what the workers raised, with their tracebacks
            add_note(exc, f"ringvod on Ray: worker {wid}: {spawner.errors[wid]}")
        raise exc
    done = sorted(spawner.results.values(), key=lambda rv: rv[0])
    return [value for _, value in done]


@dataclass
class ElasticSettings:
    """What `ElasticRayExecutor.create_settings` returns (Horovod's `ElasticSettings`)."""

    min_np: int = 1
    max_np: int | None = None
    reset_limit: int | None = None
    elastic_timeout: int = 600
    timeout_s: int = 30
    nics: set[str] | None = None
    ssh_identity_file: str | None = None
    key: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    cooldown_range: tuple[int, int] | None = None
    placement_group_timeout_s: int = 100
    elastic: bool = True


class ElasticRayExecutor:
    """Horovod's elastic executor on Ray, deprecated since Horovod 0.25 for
    `RayExecutor(min_workers=..., max_workers=...)`, which it now wraps.

    Example:
        >>> settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=4)
        >>> executor = ElasticRayExecutor(settings, cpus_per_slot=1)
        >>> executor.start()
        >>> executor.run(train_fn)   # train_fn wraps its loop in hvd.elastic.run
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: int = 600,
                        timeout_s: int = 30, ssh_identity_file: str | None = None,
                        nics: set[str] | None = None, min_np: int | None = None,
                        max_np: int | None = None,
                        cooldown_range: tuple[int, int] | None = None,
                        **kwargs: Any) -> ElasticSettings:
        """Horovod's settings of an elastic job. `cooldown_range` (seconds, as hvdrun's
        --blacklist-cooldown-range): a failed node comes back after a cooldown in that range
        instead of never."""
        if kwargs:
            warnings.warn(f"ElasticRayExecutor.create_settings: {sorted(kwargs)} have no "
                          f"effect", UserWarning, stacklevel=2)
        if ssh_identity_file is not None:
            warnings.warn("ElasticRayExecutor.create_settings: ssh_identity_file has no effect "
                          "on Ray: its workers are actors started by Ray, not over ssh",
                          UserWarning, stacklevel=2)
        for old, new, value in (("min_np", "min_num_proc", min_np),
                                ("max_np", "max_num_proc", max_np)):
            if value is not None:
                warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning,
                              stacklevel=2)
        return ElasticSettings(min_np=min_np if min_np is not None else min_num_proc,
                               max_np=max_np if max_np is not None else max_num_proc,
                               reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                               timeout_s=timeout_s, nics=set(nics) if nics else None,
                               ssh_identity_file=ssh_identity_file,
                               cooldown_range=tuple(cooldown_range) if cooldown_range else None)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: float | None = None,
                 env_vars: dict[str, Any] | None = None,
                 override_discovery: bool = True) -> None:
        if gpus_per_slot is not None and not use_gpu:  # in its own words, not RayExecutor's
            raise ValueError("gpus_per_slot is set, but use_gpu is False. use_gpu must be True "
                             "if gpus_per_slot is set.")
        warnings.warn("ElasticRayExecutor is deprecated (as in Horovod 0.25); use "
                      "RayExecutor(settings, min_workers=..., max_workers=...)",
                      DeprecationWarning, stacklevel=2)
        from .executor import RayExecutor  # noqa: PLC0415
        self._env = dict(env_vars or {})
        self._executor = RayExecutor(
            settings, min_workers=settings.min_np, max_workers=settings.max_np,
            cpus_per_worker=cpus_per_slot, use_gpu=use_gpu, gpus_per_worker=gpus_per_slot,
            reset_limit=settings.reset_limit, cooldown_range=settings.cooldown_range,
            elastic_timeout=settings.elastic_timeout, override_discovery=override_discovery)

    def start(self) -> None:
        self._executor.start(extra_env_vars=self._env)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        return self._executor.run(worker_fn, callbacks=callbacks)
