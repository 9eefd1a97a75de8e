"""Who is who in a job on Ray: ranks, local and cross ranks from the Ray nodes (no Ray import).

Ray places the workers; ringvod only learns afterwards which node each one landed on. Hosts are
keyed by Ray node id (as Horovod does), so two raylets on one machine count as two hosts. Ranks
are handed out node by node, in the order the nodes first appear, so that the ranks of a node
are consecutive exactly as `hvdrun`'s slot assignment makes them; local and cross ranks then
follow from `launcher.hosts.get_host_assignments`, the same code `hvdrun` uses.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..env import worker_env
from ..hosts import SlotInfo

__all__ = ["group_by_node", "slots_for_nodes", "rank_env"]


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
