"""Which ringvod the benchmark scripts import: a copy named on `PYTHONPATH` first (that is
how `gpu_suite.py ab` runs another revision's library), else the checkout the script sits in,
ahead of any installed copy.

A script puts its own folder first on `sys.path` itself (Python does); `use_checkout()` then
adds the checkout's root right after the `PYTHONPATH` entries, and `where()` names the folder
the library was imported from (the `LIBRARY` line the scripts print). Processes a script
starts get `pythonpath()` as their `PYTHONPATH`, the same order; `python -m launcher` and
`python -c` put their working folder first on `sys.path`, so the scripts start those in
`NO_LIBRARY`, a folder without a copy of the library."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_LIBRARY = os.path.dirname(os.path.abspath(__file__))  # benchmarks/


def _named() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def use_checkout() -> None:
    named = {os.path.abspath(p) for p in _named()}
    last = max((i for i, p in enumerate(sys.path) if p and os.path.abspath(p) in named),
               default=0)
    sys.path.insert(last + 1, ROOT)


def pythonpath() -> str:
    """`PYTHONPATH` for a child process: this process's entries, then the checkout."""
    return os.pathsep.join([*_named(), ROOT])


def where() -> str:
    """The folder holding the `collective` package this process imported."""
    import collective
    return os.path.dirname(os.path.dirname(os.path.abspath(collective.__file__)))
