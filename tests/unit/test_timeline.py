"""Timeline writer: file format, metadata, state machine, dynamic start/stop, crash safety."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from collective import _log
from collective.timeline import Timeline

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def events(path) -> list[dict]:
    return [e for e in load(path) if e["ph"] != "M"]


def pid_names(path) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in load(path)
            if e["ph"] == "M" and e["name"] == "process_name" and "name" in e["args"]}


@pytest.fixture
def tl(tmp_path):
    t = Timeline(str(tmp_path / "tl.json"))
    yield t
    t.close()


@pytest.fixture
def records():
    """Captures the `horovod` logger's records."""
    got: list[logging.LogRecord] = []

    class H(logging.Handler):
        def emit(self, record):
            got.append(record)

    h = H(level=1)
    logger = _log.get_logger()
    old = logger.level
    logger.addHandler(h)
    logger.setLevel(1)
    yield got
    logger.removeHandler(h)
    logger.setLevel(old)


def full_op(t: Timeline, name: str, ranks=(0, 1), activity="MPI_ALLREDUCE") -> None:
    t.negotiate_start(name, "ALLREDUCE")
    for r in ranks:
        t.negotiate_rank_ready(name, r)
    t.negotiate_end(name)
    t.start(name, "ALLREDUCE")
    t.activity_start_all([name], activity)
    t.activity_end_all([name])
    t.end(name, "float32", (3, 4))


def test_header_metadata_and_full_op(tl, tmp_path):
    before = time.time_ns() // 1000
    assert tl.enabled
    full_op(tl, "allreduce.x")
    tl.flush()
    recs = load(tmp_path / "tl.json")
    assert recs[0] == {"name": "process_name", "ph": "M", "pid": 0,
                       "args": {"start_time_since_epoch_in_micros":
                                recs[0]["args"]["start_time_since_epoch_in_micros"]}}
    assert abs(recs[0]["args"]["start_time_since_epoch_in_micros"] - before) < 5_000_000
    assert recs[1] == {"name": "process_sort_index", "ph": "M", "pid": 0,
                       "args": {"sort_index": 0}}
    assert recs[2] == {"name": "process_name", "ph": "M", "pid": 1,
                       "args": {"name": "allreduce.x"}}
    assert recs[3] == {"name": "process_sort_index", "ph": "M", "pid": 1,
                       "args": {"sort_index": 1}}
    evs = recs[4:]
    assert [(e["ph"], e.get("name")) for e in evs] == [
        ("B", "NEGOTIATE_ALLREDUCE"), ("X", "0"), ("X", "1"), ("E", None),
        ("B", "ALLREDUCE"), ("B", "MPI_ALLREDUCE"), ("E", None), ("E", None)]
    assert all(e["pid"] == 1 for e in evs)
    assert evs[1]["dur"] == 0 and evs[2]["dur"] == 0
    assert evs[-1]["args"] == {"dtype": "float32", "shape": "[3, 4]"}
    assert "args" not in evs[-2]
    ts = [e["ts"] for e in evs]
    assert ts == sorted(ts) and all(isinstance(x, int) and x >= 0 for x in ts)
    # Horovod's textual layout: one record per line, "[" and "]" on their own lines.
    text = (tmp_path / "tl.json").read_text()
    assert text.startswith("[\n{") and text.endswith("}\n]\n")


def test_pids_per_tensor_in_order_of_first_sight(tl, tmp_path):
    for n in ("allreduce.a", "allgather.b", "allreduce.a", "broadcast.c"):
        full_op(tl, n)
    tl.flush()
    assert pid_names(tmp_path / "tl.json") == {1: "allreduce.a", 2: "allgather.b",
                                               3: "broadcast.c"}
    sorts = [e for e in load(tmp_path / "tl.json") if e.get("name") == "process_sort_index"]
    assert [(e["pid"], e["args"]["sort_index"]) for e in sorts] == [(0, 0), (1, 1), (2, 2),
                                                                    (3, 3)]


def test_names_are_json_escaped(tl, tmp_path):
    weird = 'allreduce.a"b\\c\u00e9\n'
    full_op(tl, weird)
    tl.flush()
    assert pid_names(tmp_path / "tl.json") == {1: weird}


def test_fused_activities_and_dtype_shape_variants(tl, tmp_path):
    names = ["allreduce.a", "allreduce.b"]
    for n in names:
        tl.negotiate_start(n, "ALLREDUCE")
        tl.negotiate_end(n)
        tl.start(n, "ALLREDUCE")
    tl.activity_start_all(names, "MEMCPY_IN_FUSION_BUFFER")
    tl.activity_end_all(names)
    tl.activity_start_all(tuple(names), "MPI_ALLREDUCE")
    tl.activity_end_all(names)
    tl.end("allreduce.a", np.dtype(np.float16), ())
    tl.end("allreduce.b", "int64", [7])
    tl.flush()
    evs = events(tmp_path / "tl.json")
    acts = [(e["pid"], e["name"]) for e in evs if e["ph"] == "B" and "NEGOTIATE" not in e["name"]
            and e["name"] != "ALLREDUCE"]
    assert acts == [(1, "MEMCPY_IN_FUSION_BUFFER"), (2, "MEMCPY_IN_FUSION_BUFFER"),
                    (1, "MPI_ALLREDUCE"), (2, "MPI_ALLREDUCE")]
    ends = [e["args"] for e in evs if "args" in e]
    assert ends == [{"dtype": "float16", "shape": "[]"}, {"dtype": "int64", "shape": "[7]"}]


def test_enum_types_are_named(tl, tmp_path):
    from collective.types import DataType, RequestType, ResponseType
    tl.negotiate_start("b.x", RequestType.BROADCAST)
    tl.negotiate_end("b.x")
    tl.start("b.x", ResponseType.BROADCAST)
    tl.end("b.x", DataType.FLOAT32, (2,))
    tl.flush()
    evs = events(tmp_path / "tl.json")
    assert [e.get("name") for e in evs if e["ph"] == "B"] == ["NEGOTIATE_BROADCAST", "BROADCAST"]
    assert evs[-1]["args"] == {"dtype": "float32", "shape": "[2]"}


def test_mark_cycles(tmp_path):
    t = Timeline(str(tmp_path / "m.json"), mark_cycles=True)
    t.mark_cycle()
    t.mark_cycle()
    t.close()
    marks = [e for e in events(tmp_path / "m.json") if e["ph"] == "i"]
    assert len(marks) == 2
    assert marks[0] == {"ph": "i", "name": "CYCLE_START", "ts": marks[0]["ts"], "s": "g"}
    t = Timeline(str(tmp_path / "n.json"), mark_cycles=False)
    t.mark_cycle()
    t.close()
    assert events(tmp_path / "n.json") == []


def test_valid_json_after_every_event(tl, tmp_path):
    path = tmp_path / "tl.json"
    calls = [
        lambda: tl.negotiate_start("t", "ALLREDUCE"), lambda: tl.negotiate_rank_ready("t", 0),
        lambda: tl.negotiate_end("t"), lambda: tl.start("t", "ALLREDUCE"),
        lambda: tl.activity_start_all(["t"], "QUEUE"), lambda: tl.activity_end_all(["t"]),
        lambda: tl.end("t", "float32", (1,)),
    ]
    n = len(load(path))
    for call in calls:
        call()
        tl.flush()
        recs = load(path)
        assert len(recs) > n
        n = len(recs)


# --- state machine tolerance ----------------------------------------------------------------
def _balanced(evs: list[dict]) -> bool:
    depth: dict[int, int] = {}
    for e in evs:
        if e["ph"] == "B":
            depth[e["pid"]] = depth.get(e["pid"], 0) + 1
        elif e["ph"] == "E":
            depth[e["pid"]] = depth.get(e["pid"], 0) - 1
            if depth[e["pid"]] < 0:
                return False
    return all(v == 0 for v in depth.values())


def test_odd_orders_do_not_crash_and_stay_balanced(tl, tmp_path):
    tl.end("a", "float32", (1,))  # end without start: dropped
    tl.negotiate_end("a")  # end of a negotiation that never started
    tl.negotiate_rank_ready("a", 3)  # rank ready outside a negotiation
    tl.activity_start_all(["a"], "QUEUE")  # activity outside an op
    tl.activity_end_all(["a"])
    tl.end_error("a")
    tl.start("b", "ALLREDUCE")  # op without negotiation: fine
    tl.activity_start_all(["b"], "QUEUE")
    tl.activity_start_all(["b"], "MPI_ALLREDUCE")  # activity switch without end: closes QUEUE
    tl.end("b", "float32", (2,))  # end during an activity: closes it, then the op
    tl.negotiate_start("c", "ALLREDUCE")
    tl.start("c", "ALLREDUCE")  # start during negotiation: negotiation closed first
    tl.negotiate_start("c", "ALLREDUCE")  # re-negotiation while the op is open: op closed
    tl.end("c", "float32", (1,))  # end while negotiating: just closes the negotiation
    tl.negotiate_start("d", "ALLGATHER")
    tl.negotiate_start("d", "ALLGATHER")  # duplicate start: old span closed, new one opened
    tl.end_error("d")
    tl.start("e", "ALLREDUCE")
    tl.activity_start_all(["e"], "MPI_ALLREDUCE")
    tl.end_error("e")  # closes activity and op
    tl.start("f", "BROADCAST")
    tl.end_error("f")
    tl.start(None, "ALLREDUCE")  # garbage in: no crash
    tl.end_error(None)
    tl.start("g", "ALLREDUCE")
    tl.end("g", object(), 5)  # odd dtype and a shape that is not iterable
    tl.flush()
    evs = events(tmp_path / "tl.json")
    assert _balanced(evs)
    names = pid_names(tmp_path / "tl.json")
    assert "a" not in names.values()  # nothing was ever opened for it
    b_pid = next(p for p, n in names.items() if n == "b")
    b = [(e["ph"], e.get("name")) for e in evs if e["pid"] == b_pid]
    assert b == [("B", "ALLREDUCE"), ("B", "QUEUE"), ("E", None), ("B", "MPI_ALLREDUCE"),
                 ("E", None), ("E", None)]
    assert tl.enabled  # the writer survived


# --- dynamic start / stop / restart ----------------------------------------------------------
def test_dynamic_not_started(tmp_path):
    for path in ("", "DYNAMIC"):
        t = Timeline(path)
        assert not t.enabled and t.path == ""
        full_op(t, "x")  # dropped silently
        t.mark_cycle()
        t.close()
    assert list(tmp_path.iterdir()) == []


def test_start_stop_restart(tmp_path, records):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    t = Timeline("")
    t.stop_file()  # stopping while stopped: an info line
    assert any(r.levelno == logging.INFO and "already stopped" in r.getMessage() for r in records)
    t.start_file(a, mark_cycles=False)
    assert t.enabled and t.path == a
    full_op(t, "x")
    t.stop_file()  # blocks until flushed
    assert not t.enabled
    assert len(events(a)) == 8
    full_op(t, "dropped")  # while stopped
    with open(b, "w") as f:
        f.write("old junk that must be truncated" * 100)
    t.start_file(b, mark_cycles=True)
    t.mark_cycle()
    full_op(t, "y")
    t.flush()
    assert "dropped" not in pid_names(b).values()
    assert pid_names(b) == {1: "y"}
    assert [e["name"] for e in events(b) if e["ph"] == "i"] == ["CYCLE_START"]
    # Switching files while running: the old one is complete, the new one starts fresh.
    t.start_file(a, mark_cycles=False)
    full_op(t, "z")
    t.close()
    assert pid_names(b) == {1: "y"} and _balanced(events(b))
    assert pid_names(a) == {1: "z"}  # truncated again
    assert load(a)[0]["args"]["start_time_since_epoch_in_micros"] >= \
        load(b)[0]["args"]["start_time_since_epoch_in_micros"]


def test_same_path_is_noop(tmp_path, records):
    a = str(tmp_path / "a.json")
    t = Timeline(a)
    full_op(t, "x")
    t.flush()
    first = load(a)
    t.start_file(a, mark_cycles=True)  # no truncation, no new header; mark_cycles applies
    assert t.mark_cycles
    t.mark_cycle()
    full_op(t, "x")
    t.close()
    recs = load(a)
    assert recs[:len(first)] == first
    assert sum(1 for r in recs if r.get("name") == "process_name") == 2  # pid 0 and "x"
    assert [r["name"] for r in recs if r["ph"] == "i"] == ["CYCLE_START"]
    assert any("same as new filename" in r.getMessage() for r in records)


def test_restart_after_stop_same_path_truncates(tmp_path):
    a = str(tmp_path / "a.json")
    t = Timeline(a)
    full_op(t, "x")
    t.stop_file()
    t.start_file(a, mark_cycles=False)
    full_op(t, "y")
    t.close()
    assert pid_names(a) == {1: "y"}


def test_mid_op_restart_keeps_files_balanced(tmp_path):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    t = Timeline(a)
    t.negotiate_start("x", "ALLREDUCE")
    t.negotiate_end("x")
    t.start("x", "ALLREDUCE")
    t.activity_start_all(["x"], "MPI_ALLREDUCE")
    t.start_file(b, mark_cycles=False)
    t.activity_end_all(["x"])  # belongs to an op that started in a.json: dropped in b.json
    t.end("x", "float32", (1,))
    full_op(t, "y")
    t.close()
    assert pid_names(b) == {1: "y"} and _balanced(events(b))
    assert not _balanced(events(a))  # a.json was cut mid-op, as Horovod's would be


def test_bad_path(tmp_path, records):
    bad = str(tmp_path / "no" / "such" / "dir.json")
    t = Timeline(bad)  # at init: an error line, timeline off
    assert not t.enabled
    assert any(r.levelno == logging.ERROR and bad in r.getMessage() for r in records)
    with pytest.raises(OSError, match="directory exists"):
        t.start_file(bad, mark_cycles=False)
    assert not t.enabled
    with pytest.raises(ValueError):
        t.start_file("", mark_cycles=False)
    good = str(tmp_path / "ok.json")
    t.start_file(good, mark_cycles=False)
    full_op(t, "x")
    t.close()
    assert pid_names(good) == {1: "x"}


def test_close_is_idempotent_and_joins(tmp_path):
    t = Timeline(str(tmp_path / "a.json"))
    thread = t._thread
    assert thread.name == "hvd-timeline-writer"
    t.close()
    t.close()
    assert not thread.is_alive() and not t.enabled
    t.flush()  # no thread: no-op
    t.start_file(str(tmp_path / "b.json"), mark_cycles=False)  # usable again
    assert t.enabled
    t.close()


def test_many_events_large_batches(tl, tmp_path):
    names = [f"allreduce.grad_{i}" for i in range(300)]
    for step in range(20):
        tl.mark_cycle()
        for n in names:
            tl.negotiate_start(n, "ALLREDUCE")
            tl.negotiate_rank_ready(n, 0)
            tl.negotiate_end(n)
            tl.start(n, "ALLREDUCE")
        tl.activity_start_all(names, "MPI_ALLREDUCE")
        tl.activity_end_all(names)
        for n in names:
            tl.end(n, "float32", (10,))
    tl.flush()
    evs = events(tmp_path / "tl.json")
    assert len(evs) == 20 * 300 * 7
    assert _balanced(evs)


def test_abandoned_timeline_thread_exits(tmp_path):
    import gc
    t = Timeline(str(tmp_path / "a.json"))
    thread = t._thread
    full_op(t, "x")
    del t
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert pid_names(tmp_path / "a.json") == {1: "x"}


# --- crash safety -----------------------------------------------------------------------------
# Linux stops a write hit by SIGKILL only between pages. The writer's promise: every state a kill
# can leave is "[" + whole records (+ the closing "]" unless the kill cut a page-crossing write).
def _crash_states(writes: list[tuple[int, bytes]], page: int):
    """Every file content a SIGKILL can leave: before/after each write, and each write cut at
    each page boundary it crosses. Yields (content, cut_inside_a_write). The first write is
    the header, made under a temporary name: the path exists only once it is complete."""
    content = bytearray(writes[0][1])
    for offset, data in writes[1:]:
        yield bytes(content), False
        end = offset + len(data)
        for boundary in range((offset // page + 1) * page, end, page):
            cut = bytearray(content)
            cut[offset:boundary] = data[:boundary - offset]  # pwrite never shrinks a file
            yield bytes(cut), True
        content[offset:end] = data
    yield bytes(content), False


def _spy_writes(monkeypatch):
    import collective.timeline.tracefile as tlmod
    writes: list[tuple[int, bytes]] = []
    real = os.pwrite

    def spy(fd, data, offset):
        writes.append((offset, bytes(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(tlmod.os, "pwrite", spy)
    return writes


def test_every_kill_point_leaves_whole_records(tmp_path, monkeypatch):
    """Replays the writes and checks every state a SIGKILL could leave (deterministic)."""
    import collective.timeline.tracefile as tlmod
    from collective.timeline import load_events
    writes = _spy_writes(monkeypatch)
    t = Timeline(str(tmp_path / "p.json"), mark_cycles=True)
    for i in range(400):  # records of many lengths, so boundaries fall everywhere
        t.mark_cycle()
        full_op(t, f"allreduce.tensor_with_a_longish_name_{i % 37}" + "x" * (i % 50))
        if i % 7 == 0:
            t.flush()  # small writes as well as large batches
    full_op(t, "allreduce." + "\u00e9\"" * 5000)  # a huge name is shortened to fit a page
    t.close()
    page = tlmod._PAGE
    final = load(tmp_path / "p.json")
    assert len(writes) > 40
    assert writes[0][0] == 0 and b"process_sort_index" in writes[0][1]  # the header, renamed in
    states = cuts = 0
    for content, cut in _crash_states(writes, page):
        states += 1
        text = content.decode("ascii")
        assert text.startswith("[\n{"), text[:40]
        try:
            recs = json.loads(text)
            assert not cut or text.rstrip().endswith("]")
        except json.JSONDecodeError:
            # Only a cut page-crossing write, and it ends with a whole record and spaces.
            assert cut and text.rstrip().endswith("}"), text[-200:]
            cuts += 1
            recs = json.loads(text.rstrip() + "\n]")
        assert recs == final[:len(recs)]
        assert load_events_ok(load_events, tmp_path, content) == recs
    assert cuts > 10 and states > 2 * cuts
    for offset, data in writes:  # no write crosses more than one page boundary
        assert (offset + len(data) - 1) // page - offset // page <= 1


def load_events_ok(load_events, tmp_path, content: bytes) -> list[dict]:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    return load_events(str(path))


def test_file_appears_whole(tmp_path, monkeypatch):
    """The header is written under a temporary name and renamed: never an empty file."""
    path = tmp_path / "t.json"
    path.write_text("[\n]\n")
    seen = []
    real = os.rename

    def spy(src, dst):
        seen.append((os.path.basename(src), load(src)[0]["name"]))
        assert load(dst) == []  # the old file is still in place until the rename
        return real(src, dst)

    import collective.timeline.tracefile as tlmod
    monkeypatch.setattr(tlmod.os, "rename", spy)
    t = Timeline(str(path))
    assert seen and seen[0][1] == "process_name"
    full_op(t, "x")
    t.close()
    assert pid_names(path) == {1: "x"}
    assert sorted(os.listdir(tmp_path)) == ["t.json"]


def test_the_temporary_file_cannot_be_planted_by_another_user(tmp_path):
    """A timeline in a shared directory (/tmp): the temporary file's name is not predictable
    and it is created, never opened if it exists, so a symlink planted under a predictable name
    (the process id) neither gets the writes nor becomes the timeline."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "t.json"
    pid = os.getpid()
    for p in range(pid - 2, pid + 3):  # Horovod-style names: .<file>.<pid>.tmp
        os.symlink(victim, tmp_path / f".t.json.{p}.tmp")
    t = Timeline(str(path))
    full_op(t, "x")
    t.close()
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and pid_names(path) == {1: "x"}


# The child behaves like a training job with a saturated writer: bursts of Horovod's events for
# 160 tensors per "step" with almost no pause. Whatever moment the kill lands, the file holds
# whole records (see test_every_kill_point_leaves_whole_records for the exhaustive check).
CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from collective.timeline import Timeline
    t = Timeline(sys.argv[1], mark_cycles=True)
    names = ["allreduce.layer%d.weight" % i for i in range(160)]
    print("started", flush=True)
    while True:
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
            t.end(n, "float32", (1024,))
        time.sleep(float(sys.argv[2]))
""")


def test_loadable_after_sigkill(tmp_path):
    from collective.timeline import load_events
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=REPO))
    path = tmp_path / "killed.json"
    proc = subprocess.Popen([sys.executable, str(script), str(path), "0.001"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started", proc.stderr.read()
        deadline = time.monotonic() + 30
        while (not path.exists() or path.stat().st_size < 200_000) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    text = path.read_text()
    assert text.rstrip().endswith(("}", "]")), text[-200:]  # whole records, never a torn one
    recs = load_events(str(path))
    assert len(recs) > 1000, f"only {len(recs)} records; child stderr: {proc.stderr.read()}"
    assert recs[0]["args"]["start_time_since_epoch_in_micros"] > 0
    summary = subprocess.run([sys.executable, "-m", "collective.timeline", "summary", str(path)],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": REPO})
    assert summary.returncode == 0 and "Activities" in summary.stdout, summary.stderr


def test_set_views_name_rows_after_the_set(tl, tmp_path):
    """`for_set(0)` is the timeline itself (Horovod's names); another set's view adds
    ' [set N]' to every row, shares the file, and leaves cycle marks to the global set."""
    assert tl.for_set(0) is tl
    v2 = tl.for_set(2)
    assert tl.for_set(2) is v2 and v2.enabled and v2.path == tl.path
    full_op(tl, "allreduce.noname.1")
    full_op(v2, "allreduce.noname.1")
    v2.start("allreduce.a", "ALLREDUCE")
    v2.activity_start("allreduce.a", "QUEUE")
    v2.activity_end("allreduce.a")
    v2.end_error("allreduce.a")
    v2.mark_cycle()
    tl.flush()
    assert pid_names(tmp_path / "tl.json") == {1: "allreduce.noname.1",
                                               2: "allreduce.noname.1 [set 2]",
                                               3: "allreduce.a [set 2]"}
    evs = events(tmp_path / "tl.json")
    for pid in (1, 2):
        mine = [e for e in evs if e["pid"] == pid]
        assert [e["name"] for e in mine if e["ph"] == "B"] == [
            "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE"]
        assert sum(e["ph"] == "E" for e in mine) == 3
    assert [e["name"] for e in evs if e["pid"] == 3 and e["ph"] == "B"] == ["ALLREDUCE",
                                                                             "QUEUE"]
    assert not any(e["ph"] == "i" for e in evs)
    tl.stop_file()
    assert not v2.enabled
    v2.negotiate_start("allreduce.late", "ALLREDUCE")  # stopped: dropped


def _rows(path) -> dict[str, list[dict]]:
    names = pid_names(path)
    rows: dict[str, list[dict]] = {n: [] for n in names.values()}
    for e in events(path):
        if "pid" in e:
            rows[names[e["pid"]]].append(e)
    return rows


def test_ops_of_two_sets_under_one_name_get_a_row_each(tmp_path):
    """Unnamed ops are numbered per set (both sets' first unnamed allreduce is
    `allreduce.noname.1`) and a user name may be used in two sets at once: with both in
    flight together, each op still gets a row of its own with one whole op in it. The global
    set's rows keep Horovod's names; sets added after init() are drawn too."""
    import collective as hvd
    from tests._spmd import run_loopback
    path = tmp_path / "sets.json"

    def body(rank):
        ps = hvd.add_process_set([0, 1])
        x = np.ones(3, np.float32)
        hs = [hvd.allreduce_async(x, op=hvd.Sum),
              hvd.allreduce_async(x, op=hvd.Sum, process_set=ps),
              hvd.allreduce_async(x, name="w", op=hvd.Sum),
              hvd.allreduce_async(x, name="w", op=hvd.Sum, process_set=ps)]
        for h in hs:
            assert hvd.synchronize(h).tolist() == [2.0] * 3
        return ps.process_set_id

    ids = run_loopback(2, body, timeline=str(path), dynamic_process_sets=True)
    k = ids[0]
    rows = _rows(path)
    assert set(rows) == {"allreduce.noname.1", f"allreduce.noname.1 [set {k}]", "allreduce.w",
                         f"allreduce.w [set {k}]"}, sorted(rows)
    for name, evs in rows.items():
        assert [e["name"] for e in evs if e["ph"] == "B"][:2] == [
            "NEGOTIATE_ALLREDUCE", "ALLREDUCE"], (name, evs)
        assert sorted(e["name"] for e in evs if e["ph"] == "X") == ["0", "1"], (name, evs)
        assert sum(e["ph"] == "B" for e in evs) == sum(e["ph"] == "E" for e in evs)
        assert evs[-1]["args"] == {"dtype": "float32", "shape": "[3]"}, (name, evs)


def test_stop_timeline_without_a_timeline_only_logs(monkeypatch, records):
    """Horovod's `stop_timeline()` in a job started without HOROVOD_TIMELINE logs an info line
    and returns (only `start_timeline` refuses); a cleanup path calling it must not raise."""
    import collective as hvd
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "info")
    hvd.init()
    try:
        hvd.stop_timeline()
        assert any(r.levelno == logging.INFO and "already stopped" in r.getMessage()
                   for r in records)
        with pytest.raises(ValueError, match="Set HOROVOD_TIMELINE=DYNAMIC"):
            hvd.start_timeline("/tmp/never.json")
    finally:
        hvd.shutdown()
    with pytest.raises(ValueError, match="has not been initialized"):
        hvd.stop_timeline()


def test_a_program_exiting_without_shutdown_leaves_a_balanced_timeline(tmp_path):
    # The timeline's own exit hook ran before the runtime's shutdown (the interpreter runs
    # them in reverse order) and cut off the last cycles' end events.
    path = tmp_path / "tl.json"
    code = ("import numpy as np, collective as c\n"
            "c.init()\n"
            "hs = [c.allreduce_async(np.ones(4), name=f'x{i}') for i in range(20)]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, HOROVOD_TIMELINE=str(path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = json.loads(path.read_text())
    phases = [e.get("ph") for e in events]
    assert phases.count("B") == phases.count("E") > 0, phases


def test_start_timeline_refuses_paths_the_writer_cannot_use(tmp_path):
    # A NUL character or a bytes path killed the writer thread while start_timeline reported
    # success, and events then piled up in memory for ever.
    from collective.timeline import Timeline
    t = Timeline("")
    try:
        for bad in (str(tmp_path / "x\0.json"), str(tmp_path / "x.json").encode(), ""):
            with pytest.raises(ValueError, match="start_timeline needs a file path"):
                t.start_file(bad, False)
            assert not t.enabled
        t.start_file(str(tmp_path / "ok.json"), False)
        assert t.enabled
    finally:
        t.close()
    assert json.loads((tmp_path / "ok.json").read_text()) is not None


def test_short_writes_are_completed(monkeypatch, tmp_path):
    # os.pwrite may write less than asked (a nearly full disk): the rest is written, never a
    # torn record behind an end offset that counts it whole.
    from collective.timeline import tracefile
    real = os.pwrite
    monkeypatch.setattr(tracefile.os, "pwrite",
                        lambda fd, data, off: real(fd, bytes(data)[:7], off))
    path = tmp_path / "t.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        tracefile._pwrite_all(fd, b"0123456789" * 5, 3)
    finally:
        os.close(fd)
    assert path.read_bytes()[3:] == b"0123456789" * 5
