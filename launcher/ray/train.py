"""Ray Train: `HorovodTrainer` and `HorovodConfig` for ringvod (Ray Train V2, and V1).

Ray Train V2 refuses its own `HorovodTrainer` (Horovod no longer builds on current PyTorch);
this one runs ringvod instead. It is Ray Train's `DataParallelTrainer` with a backend that,
once Ray Train has started the workers:

1. asks each worker for its Ray node (worker index = Ray Train's world rank);
2. starts the job's authenticated rendezvous store (`KVServer`, a fresh secret unless
   `HorovodConfig.key` gives one) in the process that runs the backend (Ray Train's
   controller), on its node's address;
3. sets each worker's environment as `RayExecutor` does: rank variables with the node id as the
   host id, the tcp controller, the store's address and the secret.

`hvd.init()` in the training function then forms the job. Everything else (ScalingConfig,
RunConfig, `ray.train.report`, checkpoints, datasets, FailureConfig restarts) is Ray Train's.
With `use_gpu`, Ray Train shows each worker all the GPUs of its node (this backend asks for
that), in local-rank order, so `torch.cuda.set_device(hvd.local_rank())` is right.
"""
from __future__ import annotations

import logging
import secrets
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.constants import is_v2_enabled

from collective.rendezvous import KVServer

from .. import network
from .plan import interface_env, rank_env, slots_for_nodes

__all__ = ["HorovodConfig", "HorovodTrainer"]

_log = logging.getLogger(__name__)

if is_v2_enabled():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
else:  # RAY_TRAIN_V2_ENABLED=0
    from ray.train.data_parallel_trainer import DataParallelTrainer


_NO_EFFECT = ("verbose", "ssh_port", "ssh_identity_file", "ssh_str", "placement_group_timeout_s")


@dataclass
class HorovodConfig(BackendConfig):
    """How the ringvod job of a `HorovodTrainer` is set up (the fields of Horovod's
    `HorovodConfig`).

    Attributes:
        nics: network interfaces for the job; the first carries its traffic.
        key: the job secret (bytes); None draws a fresh one per run.
        timeout_s: rendezvous timeout in seconds (HOROVOD_GLOO_TIMEOUT_SECONDS).
        verbose, ssh_port, ssh_identity_file, ssh_str, placement_group_timeout_s: accepted for
            Horovod compatibility; no effect (Ray Train places the workers). One UserWarning
            names those that differ from their defaults.
    """

    nics: set[str] | None = None
    verbose: int = 1
    key: bytes | None = field(default=None, repr=False)
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if f.name in _NO_EFFECT
                 and getattr(self, f.name) != f.default]
        if given:
            verb = "has" if len(given) == 1 else "have"
            warnings.warn(f"HorovodConfig: {', '.join(given)} {verb} no effect (accepted for "
                          "Horovod compatibility; Ray Train places the workers)", UserWarning,
                          stacklevel=3)

    @property
    def backend_cls(self) -> type:
        return _HorovodBackend

    def to_dict(self) -> dict[str, Any]:
        return {"nics": sorted(self.nics) if self.nics else None, "timeout_s": self.timeout_s}


def _node_of_worker() -> str:
    return ray.get_runtime_context().get_node_id()


def _set_env(env: dict[str, str]) -> None:
    import os  # noqa: PLC0415
    os.environ.update(env)


class _HorovodBackend(Backend):
    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self._server: KVServer | None = None

    def on_start(self, worker_group: Any, backend_config: HorovodConfig) -> None:
        self._stop_server()
        node_ids = worker_group.execute(_node_of_worker)
        slots = slots_for_nodes(node_ids)
        iface = sorted(backend_config.nics)[0] if backend_config.nics else None
        host = network.interface_address(iface) if iface else ray.util.get_node_ip_address()
        if host is None:
            raise ValueError(f"HorovodConfig.nics: interface {iface!r} has no IPv4 address on "
                             f"the Ray Train controller's host")
        key = backend_config.key or secrets.token_bytes(32)
        self._server = KVServer(host, 0, key)
        rendezvous = self._server.start()
        extra = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(backend_config.timeout_s)}
        interface_env(backend_config.nics, extra)
        ray.get([worker_group.execute_single_async(
            slot.rank, _set_env, rank_env(slot, rendezvous, key.hex(), extra))
            for slot in slots])
        _log.debug("ringvod: %d Ray Train workers on %d node(s), rendezvous at %s:%d",
                   len(slots), len(set(node_ids)), *rendezvous)

    def on_shutdown(self, worker_group: Any, backend_config: HorovodConfig) -> None:
        self._stop_server()

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class HorovodTrainer(DataParallelTrainer):
    """Ray Train's data-parallel trainer running ringvod (Horovod's `HorovodTrainer` API).

    Example:
        >>> from ray.train import ScalingConfig, RunConfig
        >>> def train_loop(config):
        ...     import horovod.torch as hvd
        ...     import ray.train
        ...     hvd.init()
        ...     ...  # build the model, hvd.DistributedOptimizer, train
        ...     ray.train.report({"loss": loss})
        >>> trainer = HorovodTrainer(train_loop, train_loop_config={"lr": 0.1},
        ...                          scaling_config=ScalingConfig(num_workers=2),
        ...                          run_config=RunConfig(storage_path="/tmp/ray_results"))
        >>> result = trainer.fit()

    Args:
        train_loop_per_worker: the training function (taking no argument or the config).
        train_loop_config: passed to it.
        horovod_config: `HorovodConfig` (default: fresh secret, default timeouts).
        scaling_config, run_config, datasets, dataset_config, metadata,
            resume_from_checkpoint: as for Ray Train's `DataParallelTrainer`.
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], *,
                 train_loop_config: dict[str, Any] | None = None,
                 horovod_config: HorovodConfig | None = None,
                 scaling_config: Any = None, dataset_config: Any = None,
                 run_config: Any = None, datasets: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None,
                 resume_from_checkpoint: Any = None) -> None:
        super().__init__(train_loop_per_worker=train_loop_per_worker,
                         train_loop_config=train_loop_config,
                         backend_config=horovod_config or HorovodConfig(),
                         scaling_config=scaling_config, dataset_config=dataset_config,
                         run_config=run_config, datasets=datasets, metadata=metadata,
                         resume_from_checkpoint=resume_from_checkpoint)
