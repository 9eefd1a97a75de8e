"""`python -m collective.timeline summary`: golden numbers on a hand-made trace, CLI, PNG."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from collective.timeline import cli, summary
from collective.timeline import Timeline

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def meta(pid, name):
    return [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]


def B(pid, name, ts):
    return {"ph": "B", "name": name, "ts": ts, "pid": pid}


def E(pid, ts, **args):
    e = {"ph": "E", "ts": ts, "pid": pid}
    if args:
        e["args"] = args
    return e


def X(pid, rank, ts):
    return {"ph": "X", "name": str(rank), "ts": ts, "pid": pid, "dur": 0}


# Two tensors fused into one allreduce, then one of them alone, and a broadcast.
#   a: negotiate 0-100 (rank 1 last), op 110-410: memcpy_in 120-170, mpi 170-370, memcpy_out 370-400
#   b: negotiate 20-100 (rank 0 last), op 110-410 with the same (fused) activities
#   a again: negotiate 1000-1400 (rank 1 last), op 1400-1500: mpi 1400-1480
#   c: broadcast negotiate 2000-2010, op 2010-2110: MPI_BCAST 2020-2100; then one open span
GOLDEN = (
    [{"name": "process_name", "ph": "M", "pid": 0,
      "args": {"start_time_since_epoch_in_micros": 1700000000000000}},
     {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
     {"ph": "i", "name": "CYCLE_START", "ts": 0, "s": "g"}]
    + meta(1, "allreduce.a") + [B(1, "NEGOTIATE_ALLREDUCE", 0), X(1, 0, 0)]
    + meta(2, "allreduce.b") + [B(2, "NEGOTIATE_ALLREDUCE", 20), X(2, 1, 20), X(2, 0, 90),
                                X(1, 1, 95), E(1, 100), E(2, 100),
                                B(1, "ALLREDUCE", 110), B(2, "ALLREDUCE", 110),
                                B(1, "MEMCPY_IN_FUSION_BUFFER", 120),
                                B(2, "MEMCPY_IN_FUSION_BUFFER", 120), E(1, 170), E(2, 170),
                                B(1, "MPI_ALLREDUCE", 170), B(2, "MPI_ALLREDUCE", 170),
                                E(1, 370), E(2, 370),
                                B(1, "MEMCPY_OUT_FUSION_BUFFER", 370),
                                B(2, "MEMCPY_OUT_FUSION_BUFFER", 370), E(1, 400), E(2, 400),
                                E(1, 410, dtype="float32", shape="[4]"),
                                E(2, 410, dtype="float32", shape="[2, 2]"),
                                {"ph": "i", "name": "CYCLE_START", "ts": 1000, "s": "g"},
                                B(1, "NEGOTIATE_ALLREDUCE", 1000), X(1, 0, 1000),
                                X(1, 1, 1390), E(1, 1400), B(1, "ALLREDUCE", 1400),
                                B(1, "MPI_ALLREDUCE", 1400), E(1, 1480),
                                E(1, 1500, dtype="float32", shape="[4]")]
    + meta(3, "broadcast.c") + [B(3, "NEGOTIATE_BROADCAST", 2000), X(3, 0, 2000),
                                X(3, 1, 2005), E(3, 2010), B(3, "BROADCAST", 2010),
                                B(3, "MPI_BCAST", 2020), E(3, 2100),
                                E(3, 2110, dtype="float64", shape="[3]"),
                                B(3, "NEGOTIATE_BROADCAST", 3000)]
)


@pytest.fixture
def golden(tmp_path):
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(GOLDEN))
    return str(path)


def test_golden_numbers(golden):
    s = summary.summarize(summary.load_events(golden))
    assert s.start_time_since_epoch_in_micros == 1700000000000000
    assert s.duration_us == 3000 and s.cycles == 2 and s.open_spans == 1
    acts = {r.name: (r.count, r.total_us) for r in s.activities}
    assert acts == {
        "NEGOTIATE_ALLREDUCE": (3, 100 + 80 + 400),
        "NEGOTIATE_BROADCAST": (1, 10),
        "MEMCPY_IN_FUSION_BUFFER": (2, 100),
        "MPI_ALLREDUCE": (3, 400 + 80),
        "MEMCPY_OUT_FUSION_BUFFER": (2, 60),
        "MPI_BCAST": (1, 80),
    }
    total = sum(t for _, t in acts.values())
    row = next(r for r in s.activities if r.name == "MPI_ALLREDUCE")
    assert row.share == pytest.approx(480 / total) and row.mean_us == pytest.approx(160)
    assert [r.name for r in s.activities][0] == "NEGOTIATE_ALLREDUCE"  # sorted by total
    ops = {r.name: (r.count, r.total_us) for r in s.operations}
    assert ops == {"ALLREDUCE": (3, 300 + 300 + 100), "BROADCAST": (1, 100)}
    ph = s.phases
    assert ph["negotiation"]["tensor_us"] == 590
    assert ph["negotiation"]["wall_us"] == 100 + 400 + 10  # a and b overlap in 0-100
    assert ph["copies"]["tensor_us"] == 160 and ph["copies"]["wall_us"] == 80
    assert ph["data movement"]["tensor_us"] == 560
    assert ph["data movement"]["wall_us"] == 200 + 80 + 80
    # op time outside activities: fused op 10+10 per tensor, lone op 20, broadcast 10+10
    assert ph["other"]["tensor_us"] == 20 + 20 + 20 + 20
    assert ph["other"]["wall_us"] == 20 + 20 + 20
    assert ph["data movement"]["wall_share"] == pytest.approx(360 / 3000)
    assert "queue/wait" not in ph and "setup" not in ph
    t = {r.name: r for r in s.tensors}
    assert (t["allreduce.a"].ops, t["allreduce.a"].negotiations) == (2, 2)
    assert t["allreduce.a"].negotiate_us == 500 and t["allreduce.a"].op_us == 400
    assert (t["allreduce.a"].last_rank, t["allreduce.a"].last_rank_times) == (1, 2)
    assert (t["allreduce.b"].last_rank, t["allreduce.b"].last_rank_times) == (0, 1)
    assert t["broadcast.c"].negotiations == 1  # the open one is not counted
    assert [r.name for r in s.tensors] == ["allreduce.a", "allreduce.b", "broadcast.c"]


def test_text_report(golden):
    text = summary.format_summary(summary.summarize(summary.load_events(golden)))
    assert "3.000 ms traced, 3 tensors, 4 operations, 2 cycles marked, 1 spans still open" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("MPI_ALLREDUCE"))
    assert row.split() == ["MPI_ALLREDUCE", "3", "0.480", "160.0", f"{100 * 480 / 1310:.1f}%"]
    wait = lines[lines.index("Top tensors by negotiation wait") + 3]
    assert wait.split() == ["allreduce.a", "2", "0.500", "250.0", "1", "(2)"]
    phase = next(line for line in lines if line.startswith("negotiation "))
    assert phase.split() == ["negotiation", "0.590", "0.510", "17.0%"]


def test_cli_text_and_json(golden):
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "collective.timeline", "summary", golden],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Activities" in out.stdout and "MEMCPY_IN_FUSION_BUFFER" in out.stdout
    assert "RuntimeWarning" not in out.stderr
    js = subprocess.run([sys.executable, "-m", "collective.timeline", "summary", golden,
                         "--json"], capture_output=True, text=True, env=env, timeout=60)
    data = json.loads(js.stdout)
    assert data["duration_us"] == 3000
    assert data["phases"]["copies"]["wall_us"] == 80
    bad = subprocess.run([sys.executable, "-m", "collective.timeline", "summary",
                          golden + ".missing"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert bad.returncode == 2 and "error:" in bad.stderr


def test_cli_output_cut_short(golden):
    # `summary FILE | head -1`: the reader is gone before the output; no traceback.
    env = dict(os.environ, PYTHONPATH=REPO)
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader at all: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "collective.timeline", "summary", golden],
                              stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=60)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_truncated_and_object_forms(tmp_path, golden):
    text = open(golden).read()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"MPI_BCAST"') - 30])  # torn mid-record, no "]"
    s = summary.summarize(summary.load_events(str(cut)))
    assert {r.name for r in s.operations} == {"ALLREDUCE"}  # BROADCAST never closed
    assert "NEGOTIATE_BROADCAST" in {r.name for r in s.activities}
    # Horovod's old layout: records end with ",\n" and there is no closing bracket.
    lines = tmp_path / "lines.json"
    lines.write_text("[\n" + "".join(json.dumps(e) + ",\n" for e in GOLDEN))
    assert summary.summarize(summary.load_events(str(lines))).duration_us == 3000
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"traceEvents": GOLDEN}))
    assert summary.summarize(summary.load_events(str(obj))).duration_us == 3000
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(ValueError, match="no trace events"):
        summary.load_events(str(empty))


def test_recorded_file(tmp_path):
    """A file written by Timeline itself summarises consistently."""
    path = str(tmp_path / "rec.json")
    t = Timeline(path, mark_cycles=True)
    names = [f"allreduce.w{i}" for i in range(5)]
    for _ in range(3):
        t.mark_cycle()
        for n in names:
            t.negotiate_start(n, "ALLREDUCE")
            t.negotiate_rank_ready(n, 0)
            t.negotiate_rank_ready(n, 1)
            t.negotiate_end(n)
            t.start(n, "ALLREDUCE")
        for act in ("QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE",
                    "MEMCPY_OUT_FUSION_BUFFER"):
            t.activity_start_all(names, act)
            t.activity_end_all(names)
        for n in names:
            t.end(n, "float32", (8,))
    t.close()
    s = summary.summarize(summary.load_events(path))
    assert s.cycles == 3 and s.open_spans == 0
    assert {r.name: r.count for r in s.operations} == {"ALLREDUCE": 15}
    assert {r.name: r.count for r in s.activities} == {
        "NEGOTIATE_ALLREDUCE": 15, "QUEUE": 15, "MEMCPY_IN_FUSION_BUFFER": 15,
        "MPI_ALLREDUCE": 15, "MEMCPY_OUT_FUSION_BUFFER": 15}
    assert all(t.last_rank == 1 and t.last_rank_times == 3 for t in s.tensors)
    assert set(s.phases) <= set(summary.PHASES)


def test_png(golden, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "phases.png"
    assert cli.main(["summary", golden, "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib(golden, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        cli.main(["summary", golden, "--png", str(tmp_path / "x.png")])


def test_categories():
    assert summary.category_of("NEGOTIATE_ALLGATHER") == "negotiation"
    assert summary.category_of("QUEUE") == "queue/wait"
    assert summary.category_of("WAIT_FOR_DATA") == "queue/wait"
    assert summary.category_of("MEMCPY_IN_FUSION_BUFFER") == "copies"
    assert summary.category_of("COPY_ALLGATHER_OUTPUT") == "copies"
    assert summary.category_of("INIT_FUSION_BUFFER") == "setup"
    assert summary.category_of("NCCL_ALLREDUCE") == "data movement"
    assert summary.category_of("GLOO_BCAST") == "data movement"
