"""Which ringvod the benchmark scripts import: a copy named on `PYTHONPATH` first (that is
how `gpu_suite.py ab` runs another revision's library), else the checkout the script sits in,
ahead of any installed copy.

A script puts its own folder first on `sys.path` itself (Python does); `use_checkout()` then
adds the checkout's root right after the `PYTHONPATH` entries, and `where()` names the folder
the library was imported from (the `LIBRARY` line that `gpu_resnet.py` prints)."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_checkout() -> None:
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p}
    last = max((i for i, p in enumerate(sys.path) if p and os.path.abspath(p) in named),
               default=0)
    sys.path.insert(last + 1, ROOT)


def where() -> str:
    """The folder holding the `collective` package this process imported."""
    import collective
    return os.path.dirname(os.path.dirname(os.path.abspath(collective.__file__)))
