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
