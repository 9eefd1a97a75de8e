"""benchmarks/gpu_suite.py reads what the training scripts print (no GPU needed)."""
from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks")
sys.path.insert(0, BENCH)

pytest.importorskip("torch")

import _models  # noqa: E402
import gpu_suite  # noqa: E402


def test_phases_line_of_the_scripts_parses(capsys):
    parts = iter([(0.010, 0.020, 0.003, 0.0045)] * 20)
    _models.phases(lambda: next(parts), False, lambda: None, True, "ringvod")
    line = capsys.readouterr().out
    assert gpu_suite._PHASES.findall(line) == [("10.0", "20.0", "3.0", "4.5")]


def test_result_lines_parse():
    text = ("RESULT impl=ringvod world=2 amp=True compression=none batch=64 "
            "img_per_sec_total=4472.8 windows=4473 model=resnet50 unit=img/s\n")
    assert gpu_suite.parse(text) == [{"series": "ringvod", "gpus": 2, "amp": True,
                                      "compression": "none", "throughput": 4472.8}]


def test_config_labels():
    assert gpu_suite.config_of("bf16+pg") == (True, "none", True)
    assert gpu_suite.config_of("fp32+fp16") == (False, "fp16", False)
    with pytest.raises(KeyError):
        gpu_suite.config_of("fp8")


def test_timeline_part_runs_each_implementation_and_keeps_its_trace(tmp_path, monkeypatch,
                                                                     capsys):
    """`timeline` profiles ringvod (at 1 and N GPUs) and DDP, compresses each Chrome trace and
    reports each run's throughput, phases and TRACE lines."""
    s = gpu_suite.Suite(str(tmp_path), 60.0)
    ran = []

    def fake_run(cmd, timeout, env=None):
        ran.append(cmd)
        name = cmd[cmd.index("--profile-name") + 1]
        (tmp_path / f"{name}.json").write_text('{"traceEvents": []}')
        impl = "DDP" if "ddp_resnet.py" in " ".join(cmd) else "ringvod"
        return (f"RESULT impl={impl} world=2 amp=True compression=none batch=64 "
                "img_per_sec_total=1000.0 windows=1000 model=resnet50 unit=img/s\n"
                "PHASES ringvod amp=True: forward 10.0 ms, backward 20.0 ms, step 3.0 ms, "
                "gpu tail 4.5 ms\n"
                "TRACE stream 7: 900 kernels, busy 17.5 of 40.1 ms, nccl 0 (0.0 ms), "
                "first 0.0 last 40.1 ms\n")

    monkeypatch.setattr(s, "run", fake_run)
    gpu_suite.timeline(s, 2, ["bf16"], one_gpu=True)
    out = capsys.readouterr().out
    assert len(ran) == 3
    assert "gpu_resnet.py" in " ".join(ran[0]) and "-np" not in ran[0]  # 1 GPU: one process
    assert "ddp_resnet.py" in " ".join(ran[2])
    for name in ("ringvod_1gpu", "ringvod_2gpu", "DDP_2gpu"):
        stem = f"timeline_resnet50_bf16_{name}"
        assert (tmp_path / f"{stem}.json.gz").exists()
        assert not (tmp_path / f"{stem}.json").exists()
        assert f"{stem}: 1000 img/s, host ms forward/backward/step/GPU tail 10.0/20.0/3.0/4.5" \
            in out
    assert out.count("TRACE stream 7") == 3


def test_ab_part_alternates_the_libraries_and_reports_the_pairs(tmp_path, monkeypatch,
                                                                capsys):
    """`ab` runs the base library (named on PYTHONPATH) and this checkout's in pairs, which
    goes first alternating, checks the library each run imported, and reports each pair's
    ratio, the median and the spread."""
    base, label = gpu_suite.base_library("HEAD", str(tmp_path))  # a revision, exported
    assert os.path.isfile(os.path.join(base, "collective", "__init__.py"))
    assert label.startswith("HEAD (") and label != "HEAD ()"  # named with its commit
    assert gpu_suite.base_library(base, str(tmp_path / "x")) == (base, base)  # a folder as it is
    os.makedirs(tmp_path / "partial" / "collective")
    with pytest.raises(ValueError, match="no frameworks"):
        gpu_suite.base_library(str(tmp_path / "partial"), str(tmp_path))
    with pytest.raises(ValueError, match="neither a folder nor a revision"):
        gpu_suite.base_library("no-such-revision-xyz", str(tmp_path))
    with pytest.raises(ValueError, match="this checkout"):
        gpu_suite.base_library(gpu_suite.REPO, str(tmp_path))
    monkeypatch.chdir(tmp_path)  # a folder named like a revision (relative to the caller)
    for d in gpu_suite.LIBRARY:
        os.makedirs(tmp_path / "HEAD" / d)
    with pytest.raises(ValueError, match="both a folder and a git revision"):
        gpu_suite.base_library("HEAD", str(tmp_path))
    assert gpu_suite.base_library("./HEAD", str(tmp_path))[0] == str(tmp_path / "HEAD")

    s = gpu_suite.Suite(str(tmp_path), 600.0)
    order = []
    speed = iter([100.0, 110.0, 121.0, 100.0, 90.0, 99.0])  # in run order: 1.1, 1.21, 1.1

    def fake_run(cmd, timeout, env=None):
        side = "base" if env["PYTHONPATH"].startswith(base) else "current"
        order.append(side)
        v = next(speed)
        return (f"LIBRARY {env['PYTHONPATH'].split(os.pathsep)[0]}\n"
                f"RESULT impl=ringvod world=2 amp=False compression=none batch=64 "
                f"img_per_sec_total={v} windows={v} model=resnet50 unit=img/s\n")

    monkeypatch.setattr(s, "run", fake_run)
    rows = gpu_suite.ab(s, 2, ["fp32+pg"], 3, 60, base)
    out = capsys.readouterr().out
    assert order == ["base", "current", "current", "base", "base", "current"]
    got = {(r["round"], r["side"]): r["img_s"] for r in rows}
    assert got[(1, "current")] / got[(1, "base")] == pytest.approx(1.1)
    assert "ringvod (base, round 1): 100 img/s" in out
    assert "fp32+pg: 3 pairs, current/base median 1.100" in out

    # A run that imported the other side's library (the script's own checkout first on
    # sys.path, say) is not counted, and the part stops.
    s = gpu_suite.Suite(str(tmp_path), 600.0)
    monkeypatch.setattr(s, "run", lambda cmd, timeout, env=None: (
        f"LIBRARY {gpu_suite.REPO}\nRESULT impl=ringvod world=2 amp=False compression=none "
        "batch=64 img_per_sec_total=100.0 windows=100 model=resnet50 unit=img/s\n"))
    rows = gpu_suite.ab(s, 2, ["fp32+pg"], 3, 60, base)
    assert [r["img_s"] for r in rows] == [None] and rows[0]["wrong_library"]
    assert "the base run imported ringvod from" in capsys.readouterr().out

    # A pair starts only with time left for both runs (here: less than two runs' margin).
    s = gpu_suite.Suite(str(tmp_path), 50.0)
    monkeypatch.setattr(s, "run", fake_run)
    assert gpu_suite.ab(s, 2, ["fp32+pg"], 1, 60, base) == []
    assert "budget spent: skipping fp32+pg, round 1" in capsys.readouterr().out


def test_plot_trace_draws_kernels_per_stream(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": ['
                     '{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000,'
                     ' "args": {"stream": 7}},'
                     '{"cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 500,'
                     ' "dur": 2000, "args": {"stream": 16}},'
                     '{"cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 5}]}')
    _models.plot_trace(str(trace), str(tmp_path / "t.png"), "one step")
    out = capsys.readouterr().out
    assert (tmp_path / "t.png").stat().st_size > 0
    assert "TRACE stream 16: 1 kernels, busy 2.0 of 2.5 ms, nccl 1 (2.0 ms)" in out
    assert "TRACE stream 7: 1 kernels, busy 1.0 of 2.5 ms, nccl 0 (0.0 ms)" in out
