"""The coordinator: the background thread that negotiates and executes ops.

| module | its job |
|---|---|
| `loop.py` | `Coordinator`: the thread, its wait policy, one cycle (`run_cycle`) |
| `negotiate.py` | negotiation rounds: response cache, message table, fusion plan, stall check |
| `execute.py` | running agreed responses on engines, completing handles |
| `fastpath.py` | express lane and driven cycles: a synchronous op's cycle on its own thread |
| `state.py` | `ProcessSetState`: one process set's tables as this rank sees them |
| `tuning.py` | `Tuning`: the fusion threshold, cycle time, cache and bucket size in force; autotune's switches |
"""
from __future__ import annotations

from .loop import HELD, Coordinator
from .state import ProcessSetState, shutdown_error

__all__ = ["Coordinator", "HELD", "ProcessSetState", "shutdown_error"]
