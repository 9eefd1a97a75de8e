"""Shared helpers for benchmarks: JSON results, progress lines, tables and plots.

Every benchmark writes one JSON document and, for a sweep, one plot next to it::

    from _report import Progress, write_results, plot_bandwidth   # run as benchmarks/x.py
    # (or `from benchmarks._report import ...` when imported from the repository root)

    rows = []
    with Progress(len(SIZES), "allreduce sweep") as bar:
        for nbytes in SIZES:
            t = measure(nbytes)
            rows.append({"series": "ringvod mpi", "bytes": nbytes, "time_us": t * 1e6,
                         "busbw_gbs": busbw(nbytes, t, world)})
            bar.update(note=human_bytes(nbytes))
    write_results("results/allreduce_bw.json", "allreduce_bw", rows, params={"np": world})
    plot_bandwidth(rows, "results/allreduce_bw.png", title="allreduce, 2 ranks")

Row conventions (so that `python benchmarks/_report.py plot FILE.json` can redraw any result):

* bandwidth sweeps: `series`, `bytes`, `busbw_gbs` (nccl-tests bus bandwidth), optional
  `time_us`;
* scaling runs: `series` (e.g. "ringvod", "DDP"), `gpus`, `throughput` (e.g. images/s).

The JSON document is `{"benchmark", "created", "machine", "params", "results", "notes"}`;
`machine` names the host, CPU, Python/numpy/torch versions, the GPUs (from nvidia-smi) and
the git commit, because a number without its card is worthless. matplotlib is optional:
plotting without it raises an ImportError that says how to install it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

__all__ = ["machine_info", "write_results", "load_results", "Progress", "progress",
           "format_table", "human_bytes", "busbw", "algbw", "plot_bandwidth", "plot_scaling",
           "require_matplotlib"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- numbers -----------------------------------------------------------------------------------
def busbw(nbytes: float, seconds: float, world: int) -> float:
    """Allreduce bus bandwidth in GB/s, nccl-tests' definition: bytes/time × 2(n−1)/n."""
    if seconds <= 0 or world < 1:
        return 0.0
    return nbytes / seconds * (2 * (world - 1) / world if world > 1 else 1.0) / 1e9


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: bytes/time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def human_bytes(n: float) -> str:
    """1024 -> '1 KiB', 3 << 20 -> '3 MiB', 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or math.isnan(value):
            return f"{value:g}"
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


# --- results -----------------------------------------------------------------------------------
def _run(cmd: Sequence[str], timeout: float = 5.0) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=_REPO)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    """Where a number was measured: host, CPU, library versions, GPUs, git commit."""
    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
        if model:
            info["cpu"] = model
    except OSError:
        pass
    for mod in ("numpy", "torch", "cupy", "mpi4py"):
        # Only report what the benchmark already imported: importing torch costs seconds.
        m = sys.modules.get(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", "?")
    if shutil.which("nvidia-smi"):
        gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                     "--format=csv,noheader"])
        if gpus:
            info["gpus"] = [g.strip() for g in gpus.splitlines()]
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    if commit:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        info["git"] = commit + ("-dirty" if dirty else "")
    return info


def write_results(path: str, benchmark: str, results: Any, *,
                  params: Mapping[str, Any] | None = None, notes: str = "") -> dict[str, Any]:
    """Writes the benchmark's JSON document (atomically) and returns it.

    Args:
        path: output file; parent directories are created.
        benchmark: the benchmark's name, e.g. "allreduce_bw".
        results: rows (list of dicts, see the module docstring) or any JSON value.
        params: the settings the run used (sizes, ranks, iterations, engine, ...).
        notes: free text (e.g. which baseline ran in the same call).

    Raises:
        OSError: the file cannot be written.
        TypeError: `results` or `params` are not JSON-serialisable.
    """
    doc = {"benchmark": benchmark, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": machine_info(), "params": dict(params or {}), "results": results,
           "notes": notes}
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return doc


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def load_results(path: str) -> dict[str, Any]:
    """Reads a document written by `write_results`.

    Raises:
        OSError, ValueError: unreadable or not JSON.
    """
    with open(path) as f:
        return json.load(f)


# --- progress -----------------------------------------------------------------------------------
class Progress:
    """Progress lines for benchmarks that run longer than a few seconds.

    Silent for the first `show_after` seconds (short runs print nothing), then at most one
    line per `interval` seconds to stderr: ``label: 3/10 (30%), 4.2 s, ~9.8 s left: 1 MiB``.
    On a terminal the line is rewritten in place.
    """

    def __init__(self, total: int | None, label: str, *, show_after: float = 2.0,
                 interval: float = 1.0, stream: Any = None) -> None:
        self.total, self.label = total, label
        self.show_after, self.interval = show_after, interval
        self.stream = stream
        self.done = 0
        self.start = time.monotonic()
        self._last = -math.inf
        self._shown = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _out(self) -> Any:
        return self.stream if self.stream is not None else sys.stderr

    def line(self, note: str = "") -> str:
        elapsed = time.monotonic() - self.start
        text = f"{self.label}: {self.done}"
        if self.total:
            text += f"/{self.total} ({100 * self.done / self.total:.0f}%)"
        text += f", {elapsed:.1f} s"
        if self.total and 0 < self.done < self.total:
            text += f", ~{elapsed / self.done * (self.total - self.done):.1f} s left"
        return text + (f": {note}" if note else "")

    def update(self, n: int = 1, note: str = "") -> None:
        """Marks `n` more steps done; prints when due."""
        self.done += n
        now = time.monotonic()
        if now - self.start < self.show_after or now - self._last < self.interval:
            return
        self._last = now
        self._write(self.line(note))

    def _write(self, text: str) -> None:
        out = self._out()
        tty = getattr(out, "isatty", lambda: False)()
        out.write(("\r\x1b[K" + text) if tty else text + "\n")
        out.flush()
        self._shown = True

    def close(self) -> None:
        """Prints the final line if anything was shown."""
        if self._shown:
            self._write(self.line("done"))
            if getattr(self._out(), "isatty", lambda: False)():
                self._out().write("\n")
            self._shown = False


def progress(items: Iterable[Any], label: str, total: int | None = None,
             **kw: Any) -> Iterator[Any]:
    """Iterates `items`, showing a `Progress` line when the loop runs long."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, label, **kw) as bar:
        for item in items:
            yield item
            bar.update()


# --- plots -------------------------------------------------------------------------------------
def require_matplotlib() -> Any:
    """`matplotlib.pyplot` with the file-only Agg backend.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib, an optional dependency: "
                          "pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _series(rows: Iterable[Mapping[str, Any]] | Mapping[str, Sequence[tuple]], x: str,
            y: str) -> dict[str, list[tuple[float, float]]]:
    """{series: [(x, y), ...]} from rows or from an already grouped mapping."""
    if isinstance(rows, Mapping):
        return {k: sorted((float(a), float(b)) for a, b in v) for k, v in rows.items()}
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get(x) is None or r.get(y) is None:
            continue
        out.setdefault(str(r.get("series", "")), []).append((float(r[x]), float(r[y])))
    return {k: sorted(v) for k, v in out.items()}


def plot_bandwidth(rows: Any, out: str, *, title: str = "", y: str = "busbw_gbs",
                   ylabel: str = "bus bandwidth (GB/s)") -> str:
    """Bandwidth vs message size, one line per engine/baseline (`series`); log-2 x axis.

    Args:
        rows: result rows with `series`, `bytes` and `y`, or {series: [(bytes, value)]}.
        out: PNG path.
        title: figure title (say which machine/card).
        y: the row key to plot (e.g. "time_us" for a latency plot).
        ylabel: y axis label.

    Returns:
        `out`.

    Raises:
        ImportError: matplotlib is missing.
        ValueError: no rows have the keys.
    """
    data = _series(rows, "bytes", y)
    if not data:
        raise ValueError(f"no rows with 'bytes' and {y!r} to plot")
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in data.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name or "result")
    ax.set_xscale("log", base=2)
    if y.startswith("time"):
        ax.set_yscale("log")
    sizes = sorted({p[0] for pts in data.values() for p in pts})
    ax.set_xticks(sizes)
    ax.set_xticklabels([human_bytes(s) for s in sizes], rotation=45, ha="right", fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("message size")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


def plot_scaling(rows: Any, out: str, *, title: str = "", reference: str = "DDP",
                 ylabel: str = "throughput (images/s)") -> str:
    """Throughput vs GPU count per series, with ideal linear scaling from each 1-GPU point.

    Each point of a series other than `reference` is annotated with its ratio to the
    reference at the same GPU count (e.g. "1.02× DDP").

    Raises:
        ImportError: matplotlib is missing.
        ValueError: no rows have `gpus` and `throughput`.
    """
    data = _series(rows, "gpus", "throughput")
    if not data:
        raise ValueError("no rows with 'gpus' and 'throughput' to plot")
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 5))
    ref = dict(data.get(reference, []))
    for name, pts in data.items():
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        line, = ax.plot(xs, ys, marker="o", label=name or "result")
        base = dict(pts).get(1.0)
        if base:
            ax.plot(xs, [base * x for x in xs], linestyle=":", color=line.get_color(),
                    alpha=0.6, label=f"{name} ideal")
        if name != reference:
            for x, yv in pts:
                if ref.get(x):
                    ax.annotate(f"{yv / ref[x]:.2f}× {reference}", (x, yv),
                                textcoords="offset points", xytext=(4, 6), fontsize=8)
    gpus = sorted({p[0] for pts in data.values() for p in pts})
    ax.set_xticks(gpus)
    ax.set_xticklabels([f"{g:g}" for g in gpus])
    ax.set_xlabel("GPUs")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


def _save(fig: Any, out: str) -> None:
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    """`python benchmarks/_report.py plot RESULTS.json [OUT.png]`: redraw a saved sweep."""
    p = argparse.ArgumentParser(prog="benchmarks/_report.py", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plot", help="plot a results JSON (bandwidth or scaling rows)")
    pl.add_argument("results")
    pl.add_argument("out", nargs="?", help="PNG path (default: next to the JSON)")
    tb = sub.add_parser("table", help="print a results JSON as a table")
    tb.add_argument("results")
    args = p.parse_args(argv)
    doc = load_results(args.results)
    rows = doc.get("results", [])
    if args.cmd == "table":
        if rows and isinstance(rows, list) and isinstance(rows[0], dict):
            keys = list(dict.fromkeys(k for r in rows for k in r))
            print(format_table(keys, [[r.get(k, "") for k in keys] for r in rows]))
        else:
            print(json.dumps(rows, indent=1))
        return 0
    out = args.out or os.path.splitext(args.results)[0] + ".png"
    machine = doc.get("machine", {})
    where = ", ".join(machine.get("gpus", [])) or machine.get("host", "")
    title = f"{doc.get('benchmark', '')} on {where}"
    if any("gpus" in r for r in rows):
        plot_scaling(rows, out, title=title)
    else:
        plot_bandwidth(rows, out, title=title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
