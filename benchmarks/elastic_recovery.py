"""Elastic recovery time: from a worker's SIGKILL to training resuming, broken down by phase.

Usage::

    python benchmarks/elastic_recovery.py [--rounds 5] [--json results/elastic_recovery.json]

Each round runs two jobs with the default timeouts (`hvdrun --min-np ... -H ...`, tcp mode, the
toy numpy training loop of tests/_elastic_worker.py: one small allreduce per step, a commit
every 3 steps), killing one worker mid-run:

* ``2->1``: `-np 2 --min-np 1 -H localhost:1,127.0.0.1:1`, the worker of 127.0.0.1 dies;
* ``3->2``: `-np 3 --min-np 2 -H localhost:2,127.0.0.1:1`, the same.

Phases, as seen by the new rank 0 (times from the workers' and the killer's wall clocks, all on
this machine):

* detection: the kill -> the survivor's collective raises HorovodInternalError;
* rendezvous: -> the driver's answer (shutdown of the old world, the driver sees the exit and
  every survivor's request, assigns ranks);
* re-init: -> the new world is up (tcp rendezvous, connections, runtime threads);
* sync: -> state broadcast from rank 0 (and reset callbacks) done;
* first step: -> the first training step of the new world completed.

Baseline, measured in the same rounds: the job's cold start (hvdrun start -> first step
completed), i.e. what restarting the job from a checkpoint would cost at the least.

The jobs import ringvod from a copy named on `PYTHONPATH`, else this checkout (`_library.py`);
the `LIBRARY <folder>` line above the table says which.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

from _report import format_table, machine_info, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_elastic_worker.py"
CASES = {
    "2->1": ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
    "3->2": ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"],
}
PHASES = ("detection", "rendezvous", "re-init", "sync", "first step", "total")


def run_once(case: str, kill_step: int = 10, steps: int = 20) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, ET_OUT=out, ET_STEPS=str(steps), ET_COMMIT="3",
                   ET_SLEEP="0.02", ET_KILL=f"127.0.0.1:{kill_step}",
                   PYTHONPATH=_library.pythonpath())
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "launcher", *CASES[case],
                               sys.executable, str(WORKER)], cwd=_library.NO_LIBRARY, env=env,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{case}: hvdrun exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        kill = float(Path(out, "kill_times").read_text().split()[0])
        first = min(float(line.split()[0]) for p in Path(out).glob("progress.*")
                    for line in p.read_text().splitlines() if line)
        rows = [json.loads(line) for p in Path(out).glob("timings.*")
                for line in p.read_text().splitlines() if line]
        t = next(r for r in rows if r["rank"] == 0)
        return {"case": case, "cold_start": first - t0,
                "detection": t["error"] - kill, "rendezvous": t["assigned"] - t["error"],
                "re-init": t["initialized"] - t["assigned"],
                "sync": t["synced"] - t["initialized"], "first step": t["step"] - t["synced"],
                "total": t["step"] - kill}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" /
                                          "elastic_recovery.json"))
    args = ap.parse_args()
    samples = []
    for r in range(args.rounds):
        for case in CASES:
            s = run_once(case)
            samples.append(s)
            print(f"round {r + 1}/{args.rounds} {case}: total {s['total'] * 1e3:.0f} ms "
                  f"(cold start {s['cold_start']:.2f} s)", file=sys.stderr, flush=True)
    table = []
    for case in CASES:
        got = [s for s in samples if s["case"] == case]
        med = {k: statistics.median(s[k] for s in got) for k in PHASES + ("cold_start",)}
        table.append([case] + [f"{med[k] * 1e3:.0f}" for k in PHASES]
                     + [f"{med['cold_start']:.2f}", f"{med['total'] / med['cold_start']:.2f}"])
    print(f"LIBRARY {_library.where()}")
    print(format_table(["case"] + [f"{k} ms" for k in PHASES]
                       + ["cold start s", "total / cold start"], table))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    write_results(args.json, "elastic_recovery", samples,
                  params={"rounds": args.rounds, "cases": CASES})
    return 0


if __name__ == "__main__":
    sys.exit(main())
