"""The control plane's bit round alone: what one negotiation round costs before anything else.

Times `allreduce_words` of a two-word vector (what a lone cached op's round sends) on the
global set's control plane, called directly in a loop. The coordinators are stopped first
(they agree on a shutdown round; the planes stay open until `shutdown()`), so that no round
of theirs can pair with one of the loop's. Rank 0 prints the median and 90th percentile per
trial. The plane is the job's: MPI under mpirun, tcp under `hvdrun --gloo`.

    mpirun -np 2 --bind-to none python tools/control_round.py
    python -m launcher --gloo -np 2 python tools/control_round.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common  # noqa: F401 - the repository root on sys.path
import numpy as np

import collective
from collective import _current


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--trials", type=int, default=3)
    a = p.parse_args()
    collective.init()
    rt = _current.current()
    ps = rt.member_sets()[0]
    words = np.zeros(2, dtype=np.uint64)
    now = time.perf_counter
    coord = rt.coordinator
    coord.request_shutdown()  # every rank does: the coordinators end after one agreed round
    if not coord.join(60):
        raise SystemExit("the coordinator did not stop")
    for _ in range(a.trials):
        times = []
        ps.control.allreduce_words(words, "and")  # both ranks inside before timing
        for _ in range(a.iters):
            t = now()
            ps.control.allreduce_words(words, "and")
            times.append(now() - t)
        times.sort()
        if collective.rank() == 0:
            print(f"control_round plane={ps.control.name} size={collective.size()}: median "
                  f"{statistics.median(times) * 1e6:.1f} us, p90 "
                  f"{times[int(len(times) * 0.9)] * 1e6:.1f} us", flush=True)
    collective.shutdown()  # closes the planes
    return 0


if __name__ == "__main__":
    sys.exit(main())
