"""Elastic training, driver side: `hvdrun --min-np/--max-np/--host-discovery-script`.

| module | what it holds |
|---|---|
| `discovery` | host discovery (script, fixed, any callable), host order, blacklist with cooldown |
| `driver` | `ElasticDriver` (rounds, rank assignment with survivors first, reset limit, timeouts) and the key-value server hook |
| `spawn` | `WorkerSpawner`, the interface the driver starts workers through, and hvdrun's `ProcessSpawner` |
| `launch` | `run_elastic`: server + spawner + driver for hvdrun and `horovod.run` |

The worker side (state objects, the retry loop, the rendezvous request) is
`collective/elastic.py`.
"""
from .discovery import FixedHosts, HostDiscovery, HostDiscoveryScript, HostManager
from .driver import ElasticDriver, ElasticKVServer, ElasticResult, assign_slots
from .spawn import ProcessSpawner, WorkerSpawner

__all__ = ["ElasticDriver", "ElasticKVServer", "ElasticResult", "assign_slots",
           "HostDiscovery", "HostDiscoveryScript", "FixedHosts", "HostManager",
           "WorkerSpawner", "ProcessSpawner"]
