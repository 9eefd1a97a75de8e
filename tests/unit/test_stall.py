"""Stall inspector with an injected clock: when it checks, who is missing, the
exact message, shutdown marking, and the shutdown-below-warning rule."""
from __future__ import annotations

import pytest

from collective.stall import StallInspector
from collective.stall_report import SHUTDOWN_LESS_THAN_WARNING as SHUTDOWN_BELOW_WARNING
from collective.stall_report import format_stall_report

pytestmark = pytest.mark.timeout(30)

HEAD = ("One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
        "ranks and are waiting for remainder of ranks for more than 60 seconds. This may "
        "indicate that different ranks are trying to submit different tensors or that only "
        "subset of ranks is submitting tensors, which will cause deadlock. ")


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_exact_message():
    text = format_stall_report({1: ["allreduce.a", "allreduce.b"], 3: ["allgather.c"]}, set(),
                               60.0, 0.0)
    assert text == "\n".join([HEAD, "Missing ranks:", "1: [allreduce.a, allreduce.b]",
                              "3: [allgather.c]"])


def test_message_with_shutdown_and_name_limit():
    names = [f"t{i}" for i in range(8)]
    text = format_stall_report({0: names, 2: ["x"]}, {0}, 60.0, 120.0)
    lines = text.split("\n")
    assert lines[2] == "0!: [t0, t1, t2, t3, t4, t5 ...]"
    assert lines[3] == "2: [x]"
    assert lines[4] == ('One or more rank (marked by "!") is stalled for longer than 120 '
                        "seconds. Will shutdown.")


def test_ellipsis_once_a_rank_misses_six_names():
    """Horovod appends " ..." right after the sixth name, so also when there are exactly six."""
    def line(n):
        return format_stall_report({1: [f"t{i}" for i in range(n)]}, set(), 60.0, 0.0
                                   ).split("\n")[2]
    assert line(5) == "1: [t0, t1, t2, t3, t4]"
    assert line(6) == "1: [t0, t1, t2, t3, t4, t5 ...]"
    assert line(7) == "1: [t0, t1, t2, t3, t4, t5 ...]"


def test_fractional_seconds_are_shown_as_given():
    assert "more than 0.5 seconds." in format_stall_report({1: ["a"]}, set(), 0.5, 0.0)


def test_checks_at_most_once_per_warning_period():
    clock = Clock()
    s = StallInspector(60.0, 0.0, clock=clock)
    assert not s.due()
    clock.t += 59.9
    assert not s.due()
    clock.t += 0.1
    assert s.due()
    s.check({}, 2, [0, 1], set())
    assert not s.due()
    clock.t += 60.0
    assert s.due()


def test_reports_missing_ranks_of_old_names_only():
    clock = Clock()
    s = StallInspector(60.0, 0.0, clock=clock)
    pending = {"old": ({0, 2}, clock.t), "young": ({0}, clock.t + 50.0)}
    clock.t += 61.0
    report, stop = s.check(pending, 4, [10, 11, 12, 13], set())
    assert not stop
    assert report is not None and report.startswith(HEAD)
    lines = report.split("\n")
    # Global ranks of the missing process-set ranks 1 and 3; the young name is not reported.
    assert lines[1:] == ["Missing ranks:", "11: [old]", "13: [old]"]


def test_joined_ranks_are_not_missing():
    clock = Clock()
    s = StallInspector(1.0, 0.0, clock=clock)
    pending = {"a": ({0}, clock.t)}
    clock.t += 2.0
    report, _ = s.check(pending, 3, [0, 1, 2], joined={1})
    assert report.split("\n")[2:] == ["2: [a]"]


def test_nothing_stalled_gives_no_report():
    clock = Clock()
    s = StallInspector(1.0, 0.0, clock=clock)
    clock.t += 5.0
    assert s.check({"a": ({0, 1}, clock.t - 0.5)}, 2, [0, 1], set()) == (None, False)


def test_shutdown_after_shutdown_time():
    clock = Clock()
    s = StallInspector(10.0, 30.0, clock=clock)
    pending = {"a": ({0}, clock.t)}
    clock.t += 11.0
    report, stop = s.check(pending, 2, [0, 1], set())
    assert not stop and "1: [a]" in report and "!" not in report
    clock.t += 20.0
    report, stop = s.check(pending, 2, [0, 1], set())
    assert stop and "1!: [a]" in report and report.endswith(
        "is stalled for longer than 30 seconds. Will shutdown.")


def test_shutdown_time_below_warning_time_is_ignored_with_warning():
    warnings = []
    clock = Clock()
    s = StallInspector(60.0, 10.0, clock=clock, warn=warnings.append)
    assert warnings == [SHUTDOWN_BELOW_WARNING]
    assert SHUTDOWN_BELOW_WARNING == ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than "
                                      "HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown.")
    clock.t += 1000
    _, stop = s.check({"a": ({0}, clock.t - 500)}, 2, [0, 1], set())
    assert not stop


def test_disabled():
    clock = Clock()
    for s in (StallInspector(60.0, 0.0, enabled=False, clock=clock),
              StallInspector(0.0, 0.0, clock=clock)):
        clock.t += 1e6
        assert not s.due()


def test_first_warning_at_the_setting_not_a_period_later():
    """A name first seen just after a check is reported when it reaches the warning time."""
    clock = Clock()
    s = StallInspector(10.0, 0.0, clock=clock)
    clock.t += 10.0
    assert s.due()
    assert s.check({}, 2, [0, 1], set()) == (None, False)  # nothing pending yet
    pending = {"a": ({0}, clock.t + 0.5)}  # submitted half a second after that check
    clock.t += 10.0  # the regular period: "a" is 9.5 s old, not reported yet
    assert s.due()
    assert s.check(pending, 2, [0, 1], set()) == (None, False)
    clock.t += 0.49
    assert not s.due()
    clock.t += 0.01  # exactly 10 s after "a" was first seen
    assert s.due()
    report, _ = s.check(pending, 2, [0, 1], set())
    assert report is not None and "1: [a]" in report
    clock.t += 9.9  # then once per period, as Horovod repeats it
    assert not s.due()
    clock.t += 0.1
    assert s.due()


def test_shutdown_at_the_shutdown_time():
    clock = Clock()
    s = StallInspector(10.0, 15.0, clock=clock)
    pending = {"a": ({0}, clock.t)}
    clock.t += 10.0
    report, stop = s.check(pending, 2, [0, 1], set())
    assert report is not None and not stop
    clock.t += 4.99
    assert not s.due()
    clock.t += 0.01
    assert s.due()
    assert s.check(pending, 2, [0, 1], set())[1]
