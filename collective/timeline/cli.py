"""`python -m collective.timeline summary FILE [--top N] [--json] [--png OUT.png]`.

The command line of `collective.timeline.summary`; `__main__` runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .summary import format_summary, load_events, render_png, summarize

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m collective.timeline`."""
    parser = argparse.ArgumentParser(prog="python -m collective.timeline",
                                     description="Inspect a ringvod/Horovod timeline file.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help="print time tables (and optionally draw the phases)")
    p.add_argument("file", help="timeline JSON written with HOROVOD_TIMELINE")
    p.add_argument("--png", metavar="OUT.png", help="also draw the phases (needs matplotlib)")
    p.add_argument("--top", type=int, default=10, help="rows in the per-tensor tables")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead")
    args = parser.parse_args(argv)
    try:
        summary = summarize(load_events(args.file))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(summary.to_json(), indent=1))
        else:
            print(format_summary(summary, top=args.top))
        sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped early (`... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
    if args.png:
        render_png(summary, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0
