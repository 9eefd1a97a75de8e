"""benchmarks/_report.py: JSON results, progress lines, tables, bandwidth and scaling plots."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PATH = os.path.join(REPO, "benchmarks", "_report.py")
_spec = importlib.util.spec_from_file_location("bench_report", _PATH)
rep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rep)

ROWS = [{"series": s, "bytes": b, "busbw_gbs": v, "time_us": 1e6 * b / (v * 1e9)}
        for s, scale in (("ringvod mpi", 1.0), ("mpi4py raw", 1.1))
        for b, v in ((1024, 0.1 * scale), (1 << 20, 2.0 * scale), (1 << 24, 5.0 * scale))]
SCALING = [{"series": s, "gpus": g, "throughput": t}
           for s, pts in (("ringvod", ((1, 100), (2, 190), (4, 370))),
                          ("DDP", ((1, 100), (2, 185), (4, 360))))
           for g, t in pts]


def test_numbers_and_table():
    assert rep.busbw(1e9, 1.0, 2) == pytest.approx(1.0)
    assert rep.busbw(1e9, 1.0, 4) == pytest.approx(1.5)
    assert rep.busbw(1e9, 1.0, 1) == pytest.approx(1.0)
    assert rep.busbw(1e9, 0.0, 2) == 0.0
    assert rep.algbw(2e9, 2.0) == pytest.approx(1.0)
    assert rep.human_bytes(1024) == "1 KiB"
    assert rep.human_bytes(3 << 20) == "3 MiB"
    assert rep.human_bytes(1536) == "1.5 KiB"
    assert rep.human_bytes(100) == "100 B"
    table = rep.format_table(["size", "GB/s"], [["1 KiB", 0.1234], ["1 GiB", 325.93]])
    assert table.splitlines() == ["size    GB/s", "-----  -----", "1 KiB  0.123",
                                  "1 GiB  325.9"]


def test_write_and_load_results(tmp_path):
    import numpy as np
    path = str(tmp_path / "sub" / "r.json")
    doc = rep.write_results(path, "allreduce_bw", ROWS + [{"x": np.float32(1.5)}],
                            params={"np": 2, "sizes": np.array([1, 2])}, notes="same call")
    back = rep.load_results(path)
    assert back == json.loads(json.dumps(doc, default=rep._json_default))
    assert back["benchmark"] == "allreduce_bw" and back["params"] == {"np": 2, "sizes": [1, 2]}
    assert back["results"][-1] == {"x": 1.5}
    m = back["machine"]
    assert m["cpus"] == os.cpu_count() and m["python"] and "host" in m
    assert not [f for f in os.listdir(tmp_path / "sub") if ".tmp" in f]


def test_progress_quiet_then_lines():
    out = io.StringIO()
    with rep.Progress(4, "sweep", show_after=10, stream=out) as bar:
        for _ in range(4):
            bar.update()
    assert out.getvalue() == ""  # short runs print nothing
    out = io.StringIO()
    with rep.Progress(4, "sweep", show_after=0, interval=0, stream=out) as bar:
        bar.update(note="1 KiB")
        bar.update(2)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("sweep: 1/4 (25%), ") and lines[0].endswith("left: 1 KiB")
    assert lines[1].startswith("sweep: 3/4 (75%)")
    assert lines[-1].startswith("sweep: 3/4 (75%)") and lines[-1].endswith(": done")
    out = io.StringIO()
    assert list(rep.progress(range(3), "loop", show_after=0, interval=0, stream=out)) == [0, 1, 2]
    assert "loop: 3/3 (100%)" in out.getvalue()


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    bw = rep.plot_bandwidth(ROWS, str(tmp_path / "bw.png"), title="allreduce, 2 ranks")
    lat = rep.plot_bandwidth(ROWS, str(tmp_path / "lat.png"), y="time_us", ylabel="us")
    sc = rep.plot_scaling(SCALING, str(tmp_path / "scale.png"), title="ResNet-50")
    grouped = rep.plot_bandwidth({"a": [(1024, 1.0), (2048, 2.0)]}, str(tmp_path / "g.png"))
    for p in (bw, lat, sc, grouped):
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no rows"):
        rep.plot_scaling(ROWS, str(tmp_path / "none.png"))


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        rep.plot_bandwidth(ROWS, str(tmp_path / "x.png"))


def test_cli_plot_and_table(tmp_path):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "scaling.json")
    rep.write_results(path, "synthetic_torch", SCALING)
    out = subprocess.run([sys.executable, _PATH, "plot", path], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert os.path.exists(str(tmp_path / "scaling.png"))
    table = subprocess.run([sys.executable, _PATH, "table", path], capture_output=True,
                           text=True, timeout=60)
    assert table.stdout.splitlines()[0].split() == ["series", "gpus", "throughput"]
