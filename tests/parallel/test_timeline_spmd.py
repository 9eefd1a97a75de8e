"""Timeline, dynamic timeline and stall reports in real 2-rank jobs (mpirun).

Driver tests (outside ranks) launch this file under `tests/_spmd.run_spmd` with one scenario
selected by `-k`; the rank-side tests (marked `spmd`) run inside the ranks. Rank 0 checks the
timeline file after `hvd.shutdown()`; the drivers check what rank 0 logged.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from tests._spmd import run_spmd

ENV_DIR = "RINGVOD_TIMELINE_TEST_DIR"  # test protocol: where rank 0 writes its timelines
NP = 2


# --- helpers (rank side) -----------------------------------------------------------------------
def _load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)  # must be strict JSON


def _by_tensor(recs: list[dict]) -> dict[str, list[dict]]:
    names = {r["pid"]: r["args"]["name"] for r in recs
             if r.get("ph") == "M" and r.get("name") == "process_name" and "name" in r["args"]}
    out: dict[str, list[dict]] = {n: [] for n in names.values()}
    for r in recs:
        if r.get("ph") in ("B", "E", "X"):
            out[names[r["pid"]]].append(r)
    return out


def _span_names(evs: list[dict]) -> list[str]:
    return [e["name"] for e in evs if e["ph"] == "B"]


def _barrier() -> None:
    # Orders the ranks around timeline switches without an op that would itself be recorded.
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()


# --- rank-side scenarios -------------------------------------------------------------------------
@pytest.mark.spmd
@pytest.mark.timeout(60)
def test_rank_static_timeline():
    import collective as hvd
    path = os.path.join(os.environ[ENV_DIR], "static.json")
    before = time.time_ns() // 1000
    hvd.init()
    assert hvd.size() == NP
    x = hvd.allreduce(np.full(4, hvd.rank() + 1, np.float32), name="x", op=hvd.Sum)
    assert x.tolist() == [3.0] * 4
    hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum)  # unnamed: allreduce.noname.<n>
    g = hvd.allgather(np.ones((2, 3), np.float32), name="g")
    assert g.shape == (4, 3)
    hvd.broadcast(np.arange(3.0), root_rank=0, name="b")
    handles = [hvd.allreduce_async(np.ones(5, np.float32), name=f"f{i}") for i in range(4)]
    for h in handles:
        hvd.synchronize(h)
    rank = hvd.rank()
    hvd.shutdown()
    if rank != 0:
        return
    after = time.time_ns() // 1000
    recs = _load(path)
    assert recs[0]["name"] == "process_name" and recs[0]["pid"] == 0
    assert before <= recs[0]["args"]["start_time_since_epoch_in_micros"] <= after
    assert recs[1] == {"name": "process_sort_index", "ph": "M", "pid": 0,
                       "args": {"sort_index": 0}}
    tensors = _by_tensor(recs)
    assert {"allreduce.x", "allgather.g", "broadcast.b"} <= set(tensors), sorted(tensors)
    assert any(n.startswith("allreduce.noname.") for n in tensors), sorted(tensors)
    assert {f"allreduce.f{i}" for i in range(4)} <= set(tensors)
    for name, op, activity, dtype, shape in (
            ("allreduce.x", "ALLREDUCE", "MPI_ALLREDUCE", "float32", "[4]"),
            ("allgather.g", "ALLGATHER", "MPI_ALLGATHER", "float32", "[4, 3]"),
            ("broadcast.b", "BROADCAST", "MPI_BCAST", "float64", "[3]")):
        evs = tensors[name]
        spans = _span_names(evs)
        assert spans[:2] == [f"NEGOTIATE_{op}", op], (name, spans)
        assert activity in spans, (name, spans)
        assert sorted(e["name"] for e in evs if e["ph"] == "X") == [str(r) for r in range(NP)]
        assert evs[-1]["ph"] == "E" and evs[-1]["args"] == {"dtype": dtype, "shape": shape}
        assert sum(1 for e in evs if e["ph"] == "B") == sum(1 for e in evs if e["ph"] == "E")
        ts = [e["ts"] for e in evs]
        assert ts == sorted(ts)
    assert any(r.get("ph") == "i" and r["name"] == "CYCLE_START" and r["s"] == "g"
               for r in recs)
    from collective.timeline import format_summary, summarize
    summary = summarize(recs)
    assert summary.open_spans == 0
    assert "MPI_ALLREDUCE" in {r.name for r in summary.activities}
    assert "allreduce.x" in format_summary(summary)


@pytest.mark.spmd
@pytest.mark.timeout(60)
def test_rank_dynamic_timeline():
    import collective as hvd
    a = os.path.join(os.environ[ENV_DIR], "a.json")
    b = os.path.join(os.environ[ENV_DIR], "b.json")
    hvd.init()
    root = hvd.rank() == 0

    def op(name: str) -> None:
        hvd.allreduce(np.ones(2, np.float32), name=name, op=hvd.Sum)

    op("before")
    _barrier()
    hvd.start_timeline(a)
    _barrier()
    op("during1")
    hvd.stop_timeline()  # blocks until a.json holds everything
    if root:
        assert set(_by_tensor(_load(a))) == {"allreduce.during1"}
    _barrier()
    op("between")
    hvd.stop_timeline()  # stopping while stopped: an info line, no error
    _barrier()
    hvd.start_timeline(b, mark_cycles=True)
    _barrier()
    op("during2")
    hvd.start_timeline(b, mark_cycles=True)  # same file: a no-op
    op("during2b")
    _barrier()
    hvd.start_timeline(a)  # restart on a.json: truncated
    _barrier()
    op("during3")
    hvd.shutdown()
    if not root:
        return
    ta, tb = _by_tensor(_load(a)), _by_tensor(_load(b))
    assert set(ta) == {"allreduce.during3"}, sorted(ta)
    assert set(tb) == {"allreduce.during2", "allreduce.during2b"}, sorted(tb)
    assert _span_names(ta["allreduce.during3"])[:2] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
    recs_b = _load(b)
    assert sum(1 for r in recs_b if r.get("pid") == 0 and r.get("name") == "process_name") == 1
    assert any(r.get("name") == "CYCLE_START" for r in recs_b)
    assert not any(r.get("name") == "CYCLE_START" for r in _load(a))


@pytest.mark.spmd
@pytest.mark.timeout(60)
def test_rank_timeline_process_sets():
    """Rank 0 draws the ops of every process set it belongs to (Horovod's controllers share
    its one timeline), not only those of the global set; a set without rank 0 is not drawn.
    Rows of sets other than the global one carry the set, so the first unnamed allreduce of
    the global set and of another set (both `allreduce.noname.1`) get a row each."""
    import collective as hvd
    path = os.path.join(os.environ[ENV_DIR], "sets.json")
    ps0, ps1, both = hvd.ProcessSet([0]), hvd.ProcessSet([1]), hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[ps0, ps1, both])
    rank = hvd.rank()
    x = np.full(4, rank + 1.0, np.float32)
    mine = ps0 if rank == 0 else ps1
    assert hvd.allreduce(x, name=f"alone_{rank}", process_set=mine).tolist() == [rank + 1.0] * 4
    assert hvd.allreduce(x, name="pair", process_set=both, op=hvd.Sum).tolist() == [3.0] * 4
    assert hvd.allgather(x, name="pair_g", process_set=both).shape == (8,)
    hvd.allreduce(x, name="world", op=hvd.Sum)
    handles = [hvd.allreduce_async(x, op=hvd.Sum),
               hvd.allreduce_async(x, op=hvd.Sum, process_set=both)]
    for h in handles:
        assert hvd.synchronize(h).tolist() == [3.0] * 4
    ids = (ps0.process_set_id, both.process_set_id)
    hvd.shutdown()
    if rank != 0:
        return
    tensors = _by_tensor(_load(path))
    k0, kb = ids
    assert set(tensors) == {f"allreduce.alone_0 [set {k0}]", f"allreduce.pair [set {kb}]",
                            f"allgather.pair_g [set {kb}]", "allreduce.world",
                            "allreduce.noname.1", f"allreduce.noname.1 [set {kb}]"
                            }, sorted(tensors)
    for name, op in ((f"allreduce.alone_0 [set {k0}]", "ALLREDUCE"),
                     (f"allreduce.pair [set {kb}]", "ALLREDUCE"),
                     (f"allgather.pair_g [set {kb}]", "ALLGATHER"),
                     ("allreduce.noname.1", "ALLREDUCE"),
                     (f"allreduce.noname.1 [set {kb}]", "ALLREDUCE")):
        evs = tensors[name]
        assert _span_names(evs)[:2] == [f"NEGOTIATE_{op}", op], (name, _span_names(evs))
        assert f"MPI_{op}" in _span_names(evs), (name, _span_names(evs))
        assert sum(1 for e in evs if e["ph"] == "B") == sum(1 for e in evs if e["ph"] == "E")
        assert _span_names(evs).count(op) == 1, (name, _span_names(evs))
    ready = sorted(e["name"] for e in tensors[f"allreduce.pair [set {kb}]"] if e["ph"] == "X")
    assert ready == ["0", "1"]


@pytest.mark.spmd
@pytest.mark.timeout(60)
def test_rank_stall_warning():
    import collective as hvd
    with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
        hvd.start_timeline("/nonexistent/never.json")
    hvd.init()
    with pytest.raises(ValueError, match="Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic "
                                         "timeline usage."):
        hvd.start_timeline("/nonexistent/never.json")
    names = [f"stuck_{i}" for i in range(7)]
    if hvd.rank() == 1:  # rank 0 holds back for 2.5 stall periods
        handles = [hvd.allreduce_async(np.ones(2, np.float32), name=n, op=hvd.Sum)
                   for n in names]
        _barrier()
    else:
        time.sleep(2.5)
        _barrier()
        handles = [hvd.allreduce_async(np.ones(2, np.float32), name=n, op=hvd.Sum)
                   for n in names]
    for h in handles:
        assert hvd.synchronize(h).tolist() == [2.0, 2.0]
    hvd.shutdown()


@pytest.mark.spmd
@pytest.mark.timeout(60)
def test_rank_stall_shutdown():
    import collective as hvd
    hvd.init()
    if hvd.rank() == 1:
        h = hvd.allreduce_async(np.ones(2, np.float32), name="lonely", op=hvd.Sum)
        # The error names the rank whose stall check ended the job, and why.
        with pytest.raises(hvd.StallError,
                           match=r"Rank\(s\) 0 shut the job down after a stall "
                                 r"\(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
            hvd.synchronize(h)
        # So does registering a gradient set (DistributedOptimizer's first per-gradient step).
        from collective import DataType, adapter
        with pytest.raises(hvd.StallError, match=r"Rank\(s\) 0 shut the job down after a"):
            adapter.gradient_set(["allreduce.w"], [(2,)], [DataType.FLOAT32], -1,
                                 hvd.global_process_set, hvd.Sum, 1.0, 1.0)
    else:
        # Rank 0 never submits "lonely"; the stall inspector shuts the job down after 2-3 s.
        time.sleep(4)
        with pytest.raises(hvd.StallError, match=r"Rank\(s\) 0 shut the job down after a"):
            hvd.allreduce(np.ones(1, np.float32), name="after_shutdown")
    hvd.shutdown()


@pytest.mark.spmd
@pytest.mark.timeout(60)
def test_rank_stall_timing():
    """Rank 0 submits alone; its stall warning must come at the setting (2 s), not later."""
    import logging

    import collective as hvd
    from collective import _log as log_mod
    hvd.init()
    x = np.ones(2, np.float32)
    hvd.allreduce(x, name="cached", op=hvd.Sum)  # in the response cache from now on
    seen: list[tuple[float, str]] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "Missing ranks" in record.getMessage():
                seen.append((time.monotonic(), record.getMessage()))

    log_mod.get_logger().addHandler(Catch())
    delays = {}
    for name in ("lone", "cached"):  # the slow path, then a cache hit
        _barrier()
        time.sleep(1.1)  # off the inspector's period, which started at init()
        if hvd.rank() == 0:
            t0 = time.monotonic()
            h = hvd.allreduce_async(x, name=name, op=hvd.Sum)
            hvd.synchronize(h)
            hits = [t - t0 for t, msg in seen if t > t0 and f"allreduce.{name}" in msg]
            assert hits, seen
            delays[name] = hits[0]
        else:
            time.sleep(3.5)
            hvd.allreduce(x, name=name, op=hvd.Sum)
    if hvd.rank() == 0:
        print("stall warning delays:", delays, flush=True)
        assert 1.95 <= delays["lone"] <= 2.6, delays
        assert 1.95 <= delays["cached"] <= 2.8, delays  # a hit reaches rank 0 after 0.2 s
    hvd.shutdown()


# --- drivers -------------------------------------------------------------------------------
def _run(scenario: str, tmp_path, **env) -> str:
    """Runs one rank-side scenario on NP ranks; returns rank 0's log."""
    env = {ENV_DIR: str(tmp_path), "HOROVOD_LOG_HIDE_TIME": "1", **env}
    result = run_spmd(__file__, NP, timeout=90, env=env, args=["-k", scenario, "-s"])
    return result.ranks[0].log


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_static_timeline(tmp_path):
    _run("test_rank_static_timeline", tmp_path,
         HOROVOD_TIMELINE=str(tmp_path / "static.json"), HOROVOD_TIMELINE_MARK_CYCLES="1")


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_timeline_draws_every_process_set_of_rank_0(tmp_path):
    _run("test_rank_timeline_process_sets", tmp_path,
         HOROVOD_TIMELINE=str(tmp_path / "sets.json"))


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_dynamic_timeline(tmp_path):
    log = _run("test_rank_dynamic_timeline", tmp_path, HOROVOD_TIMELINE="DYNAMIC",
               HOROVOD_LOG_LEVEL="info")
    assert "Timeline is already stopped" in log, log[-3000:]


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_stall_warning_lists_missing_ranks(tmp_path):
    log = _run("test_rank_stall_warning", tmp_path, HOROVOD_STALL_CHECK_TIME_SECONDS="1")
    expected = ("Missing ranks:\n0: [allreduce.stuck_0, allreduce.stuck_1, allreduce.stuck_2, "
                "allreduce.stuck_3, allreduce.stuck_4, allreduce.stuck_5 ...]")
    assert expected in log, log[-3000:]
    assert ("waiting for remainder of ranks for more than 1 seconds. This may indicate that "
            "different ranks are trying to submit different tensors") in log
    assert "[0][W " in log  # rank prefix, level letter, no timestamp (HOROVOD_LOG_HIDE_TIME)
    assert "Will shutdown" not in log


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_stall_warning_comes_at_the_setting(tmp_path):
    _run("test_rank_stall_timing", tmp_path, HOROVOD_STALL_CHECK_TIME_SECONDS="2")


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_stall_shutdown_marks_ranks(tmp_path):
    log = _run("test_rank_stall_shutdown", tmp_path, HOROVOD_STALL_CHECK_TIME_SECONDS="1",
               HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="2")
    assert "0!: [allreduce.lonely]" in log, log[-3000:]
    assert ('One or more rank (marked by "!") is stalled for longer than 2 seconds. '
            "Will shutdown.") in log
    assert "[0][E " in log


HVDRUN_SCRIPT = """
import numpy as np
import collective as hvd
hvd.init()
hvd.allreduce(np.ones(3, np.float32), name="via_hvdrun", op=hvd.Sum)
hvd.shutdown()
"""


@pytest.mark.spmd_driver
@pytest.mark.timeout(150)
def test_hvdrun_timeline_flags(tmp_path):
    """`hvdrun --timeline-filename F --timeline-mark-cycles` reaches rank 0's timeline."""
    import subprocess
    import sys

    from tests._spmd import REPO
    script = tmp_path / "job.py"
    script.write_text(HVDRUN_SCRIPT)
    out = tmp_path / "hvdrun.json"
    env = dict(os.environ, PYTHONPATH=REPO)
    for k in ("HOROVOD_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RINGVOD_SPMD_CHILD"):
        env.pop(k, None)
    try:
        proc = subprocess.run([sys.executable, "-m", "launcher", "-np", str(NP),
                               "--timeline-filename", str(out), "--timeline-mark-cycles",
                               sys.executable, str(script)], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hvdrun timed out:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"hvdrun failed:\n{proc.stdout}\n{proc.stderr}"
    recs = _load(str(out))
    tensors = _by_tensor(recs)
    assert "allreduce.via_hvdrun" in tensors, (sorted(tensors), proc.stdout, proc.stderr)
    assert "ALLREDUCE" in _span_names(tensors["allreduce.via_hvdrun"])
    assert any(r.get("name") == "CYCLE_START" for r in recs)
