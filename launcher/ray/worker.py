"""`BaseHorovodWorker`: the actor class of a `RayExecutor` job (Horovod's name and methods).

Each worker is one Ray actor, i.e. one long-lived process: the executor sets the job's
variables in its environment (`update_env_vars`) before any user code runs, and user functions
then call `hvd.init()` as they would under `hvdrun`. Subclass it to keep state in the worker
between calls; `start(executable_cls=...)` builds one object per worker that `execute(fn)`
passes to `fn`.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable, Mapping

import ray

__all__ = ["BaseHorovodWorker"]


class BaseHorovodWorker:
    """A job member. Ray runs it as an actor; its methods run in the worker's process.

    Attributes:
        executable: the object built by `start_executable`, or None.
    """

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)
        os.environ["HOROVOD_HOSTNAME"] = self.node_id()

    def node_id(self) -> str:
        """The Ray node id of this worker's node (its host id in the job)."""
        return ray.get_runtime_context().get_node_id()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> list[int]:
        """The GPUs Ray assigned to this worker."""
        return [int(g) if str(g).isdigit() else g for g in ray.get_gpu_ids()]

    def placement(self) -> tuple[str, str, str, int, list[Any]]:
        """(node id, node IP, hostname, pid, GPU ids): everything the executor needs at start."""
        return self.node_id(), self.node_ip(), self.hostname(), os.getpid(), self.get_gpu_ids()

    def update_env_vars(self, env_vars: Mapping[str, Any]) -> None:
        """Sets variables in this worker's environment (values are turned into strings)."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def start_executable(self, executable_cls: type | None = None,
                         executable_args: list[Any] | None = None,
                         executable_kwargs: dict[str, Any] | None = None) -> None:
        """Builds `executable_cls(*args, **kwargs)` in this worker (after the env is set)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []),
                                             **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """Runs `func(self.executable)` here and returns its result."""
        return func(self.executable)
