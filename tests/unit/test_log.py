"""Logger format (Horovod's line, rank/host prefix, hide-time, levels) and the stall report."""
from __future__ import annotations

import logging
import re

import pytest

from collective import _log
from collective.stall_report import (SHUTDOWN_LESS_THAN_WARNING, format_stall_report)

pytestmark = pytest.mark.timeout(30)

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}"


class _Err:
    def __init__(self, capsys):
        self.capsys, self.text = capsys, ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def err(capsys):
    """What the logger wrote to (the current) sys.stderr; restores the logger afterwards."""
    level = _log.get_logger().level
    capsys.readouterr()
    yield _Err(capsys)
    _log.configure("warning")
    _log.get_logger().setLevel(level)


def _lines(buf) -> list[str]:
    return buf.getvalue().splitlines()


def test_horovod_line_format_with_rank(err):
    _log.configure("warning", hide_time=False, rank=3)
    _log.get_logger().warning("hello %s", "world")
    line, = _lines(err)
    assert re.fullmatch(r"\[3\]\[" + STAMP + r": W test_log\.py:\d+\] hello world", line), line


def test_hide_time_and_host_prefix(err):
    _log.configure("info", hide_time=True, rank=5, host="node2")
    _log.get_logger().info("x")
    _log.get_logger().error("y")
    a, b = _lines(err)
    assert re.fullmatch(r"\[node2:5\]\[I test_log\.py:\d+\] x", a), a
    assert re.fullmatch(r"\[node2:5\]\[E test_log\.py:\d+\] y", b), b


def test_no_rank_prefix_before_init(err):
    _log.configure("warning", hide_time=True)
    _log.get_logger().critical("boom")
    line, = _lines(err)
    assert re.fullmatch(r"\[F test_log\.py:\d+\] boom", line), line


@pytest.mark.parametrize("name,shown", [
    ("trace", "TDIWEF"), ("debug", "DIWEF"), ("info", "IWEF"), ("warning", "WEF"),
    ("WARN", "WEF"), ("error", "EF"), ("fatal", "F"), (" Info ", "IWEF")])
def test_levels(err, name, shown):
    _log.configure(name, hide_time=True, rank=0)
    log = _log.get_logger()
    _log.trace("t")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    log.critical("f")
    letters = "".join(line[4] for line in _lines(err))
    assert letters == shown


def test_trace_reports_the_callers_line(err):
    _log.configure("trace", hide_time=True, rank=0)
    _log.trace("here")
    line, = _lines(err)
    assert re.fullmatch(r"\[0\]\[T test_log\.py:\d+\] here", line), line


def test_unknown_level_warns_and_uses_warning(err):
    _log.configure("loud", hide_time=True, rank=1)
    assert _log.get_logger().level == logging.WARNING
    line, = _lines(err)
    assert "HOROVOD_LOG_LEVEL='loud' is not a log level" in line
    with pytest.raises(ValueError, match="trace, debug, info, warning, error, fatal"):
        _log.parse_level("loud")


def test_reconfigure_updates_prefix(err):
    _log.configure("warning", hide_time=True, rank=0)
    _log.configure("warning", hide_time=True, rank=7)  # e.g. an elastic re-init
    _log.get_logger().warning("once")
    line, = _lines(err)  # one handler, the newest prefix
    assert line.startswith("[7][W ")


def test_exception_text_follows(err):
    _log.configure("warning", hide_time=True, rank=0)
    try:
        raise RuntimeError("bad thing")
    except RuntimeError:
        _log.get_logger().exception("failed")
    text = err.getvalue()
    assert text.startswith("[0][E ") and "RuntimeError: bad thing" in text


def test_log_once(err):
    _log.configure("warning", hide_time=True, rank=0)
    assert _log.log_once("evict-test", logging.WARNING, "evicted %d", 1)
    assert not _log.log_once("evict-test", logging.WARNING, "evicted %d", 2)
    assert _lines(err) == [_lines(err)[0]] and "evicted 1" in _lines(err)[0]


# --- stall report ---------------------------------------------------------------------------
HEAD = ("One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
        "ranks and are waiting for remainder of ranks for more than {t} seconds. This may "
        "indicate that different ranks are trying to submit different tensors or that only "
        "subset of ranks is submitting tensors, which will cause deadlock. ")


def test_stall_report_warning():
    text = format_stall_report({1: ["allreduce.b", "allreduce.a"], 0: ["allgather.c"]}, set(),
                               60.0, 0.0)
    assert text == "\n".join([
        HEAD.format(t=60), "Missing ranks:", "0: [allgather.c]",
        "1: [allreduce.a, allreduce.b]"])


def test_stall_report_truncates_after_six_names():
    names = [f"allreduce.t{i}" for i in range(8)]
    text = format_stall_report({2: names}, set(), 1, 0)
    assert text.splitlines()[-1] == ("2: [allreduce.t0, allreduce.t1, allreduce.t2, "
                                     "allreduce.t3, allreduce.t4, allreduce.t5 ...]")
    six = format_stall_report({2: names[:6]}, set(), 1, 0)  # Horovod's " ..." follows the 6th
    assert six.splitlines()[-1].endswith("allreduce.t5 ...]")
    five = format_stall_report({2: names[:5]}, set(), 1, 0)
    assert five.splitlines()[-1].endswith("allreduce.t4]")


def test_stall_report_shutdown():
    text = format_stall_report({0: ["x"], 3: ["x", "y"]}, {3}, 10, 30)
    assert text.splitlines()[1:] == [
        "Missing ranks:", "0: [x]", "3!: [x, y]",
        'One or more rank (marked by "!") is stalled for longer than 30 seconds. Will shutdown.']
    assert text.startswith(HEAD.format(t=10))
    assert "1.5 seconds" in format_stall_report({0: ["x"]}, set(), 1.5, 0)
    assert format_stall_report({}, set(), 60, 0) == ""
    assert SHUTDOWN_LESS_THAN_WARNING == ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than "
                                          "HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown.")


def test_stall_report_matches_the_runtime_inspector():
    """The coordinator's own formatter (collective/stall.py) prints the same text."""
    stall = pytest.importorskip("collective.stall")
    missing = {0: [f"n{i}" for i in range(7)], 1: ["a"]}
    assert stall.format_stall_report(missing, {1}, 5, 9) == format_stall_report(
        missing, {1}, 5, 9)
