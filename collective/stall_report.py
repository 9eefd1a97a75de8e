"""The stall inspector's report text, word for word Horovod's.

Pure formatting: the coordinator's stall inspector decides which ranks are missing which
tensors and whether to shut down; this module only turns that into the message Horovod users
know (and grep their logs for).
"""
from __future__ import annotations

from typing import Iterable, Mapping

__all__ = ["format_stall_report", "SHUTDOWN_LESS_THAN_WARNING", "MAX_NAMES_PER_RANK"]

MAX_NAMES_PER_RANK = 6

SHUTDOWN_LESS_THAN_WARNING = ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than "
                              "HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown.")


def _seconds(value: float) -> str:
    # Horovod holds these as whole seconds; keep "60", not "60.0", and show fractions as given.
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def format_stall_report(missing: Mapping[int, Iterable[str]], shutdown_ranks: Iterable[int],
                        warning_time: float, shutdown_time: float) -> str:
    """Builds Horovod's stall warning.

    Ranks are listed in ascending order, each with its missing tensor names sorted (Horovod
    keeps them in a std::set), at most six names; " ..." follows the sixth (also when there
    are exactly six, as in Horovod). A rank in `shutdown_ranks`
    is marked "!" and the shutdown sentence is appended; the caller logs the text as ERROR in
    that case and as WARNING otherwise.

    Args:
        missing: global rank -> names of the tensors that rank has not submitted.
        shutdown_ranks: ranks stalled past the shutdown time.
        warning_time: HOROVOD_STALL_CHECK_TIME_SECONDS.
        shutdown_time: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (used only when shutting down).

    Returns:
        The multi-line message, or "" when `missing` is empty.
    """
    if not missing:
        return ""
    marked = set(shutdown_ranks)
    lines = [
        "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
        "ranks and are waiting for remainder of ranks for more than "
        f"{_seconds(warning_time)} seconds. This may indicate that different ranks are trying "
        "to submit different tensors or that only subset of ranks is submitting tensors, which "
        "will cause deadlock. ",
        "Missing ranks:",
    ]
    for rank in sorted(missing):
        names = sorted(set(missing[rank]))
        text = ", ".join(names[:MAX_NAMES_PER_RANK])
        if len(names) >= MAX_NAMES_PER_RANK:  # Horovod's loop adds it after the sixth name
            text += " ..."
        lines.append(f"{rank}{'!' if rank in marked else ''}: [{text}]")
    if marked:
        lines.append('One or more rank (marked by "!") is stalled for longer than '
                     f"{_seconds(shutdown_time)} seconds. Will shutdown.")
    return "\n".join(lines)
