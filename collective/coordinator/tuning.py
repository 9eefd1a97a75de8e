"""Autotune's place in the coordinator: the parameters in force and the switch between them.

`collective.autotune` searches; this holds what every rank applies (fusion threshold, cycle
time) and moves rank 0's new values to every rank at a negotiation round they all share:

* each round of the global set (`wants_retune`) counts in `rounds`; global rank 0 clears the
  round's inverted retune status bit while its tuner has new parameters (`Driver.pending`);
* a round whose AND has the bit clear broadcasts them (`retune`) on every rank, after the
  invalid-bit exchange and before the round's fusion plan, so the plan of that round and
  every later one uses the new threshold everywhere;
* the execute path feeds each executed allreduce of the global set to the tuner (`driver`,
  None on every other rank and once tuning ended: one attribute check per op).
"""
from __future__ import annotations

from typing import Any

from .. import _log, autotune
from .state import ProcessSetState

__all__ = ["Tuning"]


class Tuning:
    """The tunable parameters of one coordinator, shared by its negotiator, loop and execute
    path."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.fusion_threshold: int = config.fusion_threshold  # bytes
        self.cycle_time: float = config.cycle_time  # seconds
        self.driver: autotune.Driver | None = None  # global rank 0 while autotune runs
        self.rounds = 0  # negotiation rounds of the global set
        self.retunes: list[tuple[int, autotune.Params]] = []  # (round, parameters applied)

    def start(self, rank: int) -> None:
        """At the coordinator's start: global rank 0 creates the tuner when autotune is on."""
        if self.config.autotune and rank == 0:
            self.driver = autotune.from_config(self.config)

    def wants_retune(self, ps: ProcessSetState) -> bool:
        """Called once per negotiation round, just before its AND allreduce: True when this
        rank clears the round's retune bit (global rank 0 with new parameters, set 0 only)."""
        if ps.id != 0:
            return False
        self.rounds += 1
        return self.driver is not None and self.driver.pending

    def retune(self, ps: ProcessSetState) -> None:
        """Global rank 0's parameters, broadcast over `ps` (the global set) and applied on
        every rank (whether or not this rank has a tuner)."""
        driver = self.driver
        data = ps.control.bcast(driver.publish() if driver is not None else None)
        p = autotune.Params.decode(data)
        self.fusion_threshold = p.fusion_threshold
        self.cycle_time = max(p.cycle_time_ms, 0.0) / 1000.0
        self.retunes.append((self.rounds, p))
        if not p.active:
            self.driver = None  # tuning ended: these values stay
        _log.trace("autotune: round %d: fusion threshold %d, cycle time %g ms", self.rounds,
                   p.fusion_threshold, p.cycle_time_ms)
