"""Who is who in a job on Ray: ranks, local and cross ranks from the Ray nodes (no Ray import).

Ray places the workers; ringvod only learns afterwards which node each one landed on. Hosts are
keyed by Ray node id (as Horovod does), so two raylets on one machine count as two hosts. Ranks
are handed out node by node, in the order the nodes first appear, so that the ranks of a node
are consecutive exactly as `hvdrun`'s slot assignment makes them; local and cross ranks then
follow from `launcher.hosts.get_host_assignments`, the same code `hvdrun` uses.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..env import worker_env
from ..hosts import SlotInfo

__all__ = ["group_by_node", "slots_for_nodes", "rank_env", "interface_env", "visible_gpus"]


def group_by_node(node_ids: Sequence[str]) -> list[int]:
    """The order in which to rank workers: `order[rank]` is the index of the worker that gets
    `rank`. Workers of one node get consecutive ranks; nodes keep their first-seen order and
    workers keep their order within a node.

    Example:
        >>> group_by_node(["a", "b", "a"])
        [0, 2, 1]
    """
    nodes: dict[str, list[int]] = {}
    for i, node in enumerate(node_ids):
        nodes.setdefault(node, []).append(i)
    return [i for members in nodes.values() for i in members]


def slots_for_nodes(node_ids: Sequence[str]) -> list[SlotInfo]:
    """The slot of every rank from the node each rank runs on.

    local_rank counts the lower ranks on the same node; cross_rank is the position of the node,
    in first-seen order, among the nodes that have a rank with that local_rank (what `hvdrun`'s
    slot assignment gives, and what `hvd.init()` computes from the host ids). Ranks of a node
    need not be consecutive (Ray Train orders its workers itself).

    Args:
        node_ids: the Ray node id of rank 0, 1, ...

    Raises:
        ValueError: no workers.
    """
    if not node_ids:
        raise ValueError("a job on Ray needs at least one worker")
    order: list[str] = []
    seen: dict[str, int] = {}
    local_ranks = []
    for node in node_ids:
        if node not in seen:
            order.append(node)
            seen[node] = 0
        local_ranks.append(seen[node])
        seen[node] += 1
    cross_hosts: dict[int, list[str]] = {}
    for node in order:
        for lr in range(seen[node]):
            cross_hosts.setdefault(lr, []).append(node)
    return [SlotInfo(hostname=node, rank=r, local_rank=lr,
                     cross_rank=cross_hosts[lr].index(node), size=len(node_ids),
                     local_size=seen[node], cross_size=len(cross_hosts[lr]))
            for r, (node, lr) in enumerate(zip(node_ids, local_ranks))]


def rank_env(slot: SlotInfo, rendezvous: tuple[str, int] | None, secret_hex: str | None,
             extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables one worker sets in its process before `hvd.init()`: rank, size, local and
    cross rank, the node id as HOROVOD_HOSTNAME, the tcp controller, the rendezvous address and
    the job secret, plus `extra` (which the job's own variables override)."""
    return worker_env({}, slot, remote=True, overrides={k: str(v) for k, v in
                                                        (extra or {}).items()},
                      rendezvous=rendezvous, secret_hex=secret_hex, oversubscribed=False)


def interface_env(nics: Any, env: dict[str, str]) -> None:
    """Pins the job's traffic to `nics` in a worker's `env`, as Horovod and `hvdrun
    --network-interface` do: HOROVOD_GLOO_IFACE is the first interface (by name, the one the
    rendezvous store binds to), NCCL_SOCKET_IFNAME lists them all unless `env` already sets it.
    Without `nics`, `env` is left as it is."""
    names = sorted(nics or ())
    if names:
        env["HOROVOD_GLOO_IFACE"] = names[0]
        env.setdefault("NCCL_SOCKET_IFNAME", ",".join(names))


def _gpu_order(gpu_id: str) -> tuple[int, int, str]:
    """Sort key of a Ray GPU id: numbers numerically ("2" before "10"), then other ids (GPU
    UUIDs) as text."""
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def visible_gpus(node_ids: Sequence[str], gpu_ids: Sequence[Sequence[Any]]) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of every rank: the GPUs Ray gave the ranks of its node, each
    listed once.

    A node's list follows its ranks in order (local-rank order), each rank's ids numerically;
    an id that a lower rank of the node already brought is not repeated. With one GPU per
    worker, GPU `hvd.local_rank()` of the list is therefore the one Ray gave the worker. Workers
    that share a GPU (fractional GPUs: Ray gives both the same id) leave the node fewer GPUs
    than workers.

    Args:
        node_ids: the Ray node id of rank 0, 1, ...
        gpu_ids: the GPU ids Ray gave rank 0, 1, ... (`ray.get_gpu_ids()`: ints or strings).

    Example:
        >>> visible_gpus(["a", "a", "b"], [[1], [0], [0]])
        ['1,0', '1,0', '0']
        >>> visible_gpus(["a", "a", "a"], [[0], [0], [1]])  # 0.5 GPU each
        ['0,1', '0,1', '0,1']
    """
    if len(node_ids) != len(gpu_ids):
        raise ValueError(f"{len(node_ids)} node ids but {len(gpu_ids)} GPU id lists")
    of_node: dict[str, dict[str, None]] = {}
    for node, ids in zip(node_ids, gpu_ids):
        seen = of_node.setdefault(node, {})
        for g in sorted({str(g) for g in ids}, key=_gpu_order):
            seen.setdefault(g, None)
    return [",".join(of_node[node]) for node in node_ids]
