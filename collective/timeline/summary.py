"""`python -m collective.timeline summary FILE [--png OUT.png]`: what a timeline says.

Reads a timeline written by `collective.timeline.Timeline` (or by Horovod itself) and prints:

* **Activities**: every nested span (`QUEUE`, `MEMCPY_IN_FUSION_BUFFER`, `MPI_ALLREDUCE`, …) and
  every negotiation (`NEGOTIATE_ALLREDUCE`): count, total, mean and share of the table's total.
* **Operations**: the top-level spans (`ALLREDUCE`, `ALLGATHER`, …).
* **Phases**: negotiation wait vs. data movement vs. copies vs. queueing/setup, both as
  tensor-time (spans summed over tensors, so fused tensors count once each) and as wall time
  (the union of the spans' intervals, which is what a step actually spends).
* **Tensors**: per tensor name, how many ops, negotiation and op time.
* **Top tensors by negotiation wait**, with the rank that arrived last most often: the rank
  the others were waiting for.

Times in the file are integer microseconds since the timeline started. A file cut short (a
killed job) is read up to its last complete record; spans still open at the end are counted
and left out of the numbers. `--png` draws the phases per tensor over time (needs matplotlib,
an optional dependency).
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

__all__ = ["load_events", "summarize", "format_summary", "render_png", "category_of", "Summary"]

PHASES = ("negotiation", "queue/wait", "setup", "copies", "data movement", "other")
_WAIT = {"QUEUE", "WAIT_FOR_DATA", "WAIT_FOR_OTHER_TENSOR_DATA"}


def category_of(span_name: str) -> str:
    """The phase a span belongs to (see PHASES)."""
    if span_name.startswith("NEGOTIATE_"):
        return "negotiation"
    if span_name in _WAIT:
        return "queue/wait"
    if span_name.startswith(("MEMCPY_", "COPY_")):
        return "copies"
    if span_name.startswith(("INIT_", "ALLOCATE_")):
        return "setup"
    return "data movement"


def load_events(path: str) -> list[dict]:
    """Loads a timeline file, also one left by a killed job.

    ringvod's writer leaves whole records, at worst without the closing `]`; files from other
    writers may also end in `,` or in a torn record, which is skipped.

    Raises:
        OSError: the file cannot be read.
        ValueError: nothing in the file parses as a trace record.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = _salvage(text)
    if isinstance(data, dict):  # the object form of the trace-event format
        data = data.get("traceEvents", [])
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path} holds no trace events; is it a timeline written with "
                         "HOROVOD_TIMELINE or hvd.start_timeline()?")
    return [e for e in data if isinstance(e, dict)]


def _salvage(text: str) -> list:
    """The complete records of a cut-short array (Chrome's viewer accepts those files too)."""
    dec = json.JSONDecoder()
    out: list = []
    i, n = text.find("[") + 1, len(text)
    if i == 0:
        return out
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out
        out.append(obj)


@dataclass
class Span:
    tensor: str
    name: str
    start: int  # µs
    end: int
    depth: int  # 0 = negotiation or top-level op, 1 = activity inside an op
    child_us: int = 0  # time covered by nested spans (activities of an op)


@dataclass
class Row:
    name: str
    count: int = 0
    total_us: float = 0.0
    share: float = 0.0

    @property
    def mean_us(self) -> float:
        return self.total_us / self.count if self.count else 0.0


@dataclass
class TensorRow:
    name: str
    ops: int = 0
    negotiations: int = 0
    negotiate_us: float = 0.0
    op_us: float = 0.0
    last_rank: int | None = None  # the rank that arrived last most often
    last_rank_times: int = 0


@dataclass
class Summary:
    start_time_since_epoch_in_micros: int | None
    duration_us: int
    cycles: int
    open_spans: int
    activities: list[Row]
    operations: list[Row]
    phases: dict[str, dict[str, float]]  # phase -> {"tensor_us", "wall_us", "wall_share"}
    tensors: list[TensorRow]
    spans: list[Span] = field(repr=False, default_factory=list)
    cycle_ts: list[int] = field(repr=False, default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("spans")
        d.pop("cycle_ts")
        for row in d["activities"] + d["operations"]:
            row["mean_us"] = row["total_us"] / row["count"] if row["count"] else 0.0
        return d


def _union(intervals: list[tuple[int, int]]) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize(events: Sequence[dict]) -> Summary:
    """Rebuilds the spans of a timeline and aggregates them (see the module docstring)."""
    names: dict[Any, str] = {}
    epoch = None
    stacks: dict[Any, list[list]] = defaultdict(list)  # pid -> [name, start, child_us]
    spans: list[Span] = []
    arrivals: dict[Any, list[int]] = {}  # pid -> ranks in arrival order (open negotiation)
    last_ranks: dict[str, Counter] = defaultdict(Counter)
    cycle_ts: list[int] = []
    ts_min, ts_max = None, None
    for ev in events:
        ph, pid = ev.get("ph"), ev.get("pid", 0)
        if ph == "M":
            args = ev.get("args") or {}
            if ev.get("name") == "process_name":
                if "name" in args:
                    names[pid] = str(args["name"])
                if "start_time_since_epoch_in_micros" in args:
                    epoch = int(args["start_time_since_epoch_in_micros"])
            continue
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)):
            continue
        ts_min = ts if ts_min is None or ts < ts_min else ts_min
        ts_max = ts if ts_max is None or ts > ts_max else ts_max
        tensor = names.get(pid, f"pid {pid}")
        stack = stacks[pid]
        if ph == "B":
            name = str(ev.get("name", ""))
            stack.append([name, ts, 0])
            if name.startswith("NEGOTIATE_"):
                arrivals[pid] = []
        elif ph == "E":
            if not stack:
                continue
            name, start, child = stack.pop()
            spans.append(Span(tensor, name, start, ts, len(stack), child))
            if stack:
                stack[-1][2] += ts - start
            ranks = arrivals.pop(pid, None) if name.startswith("NEGOTIATE_") else None
            if ranks:
                last_ranks[tensor][ranks[-1]] += 1
        elif ph == "X":
            if pid in arrivals:
                try:
                    arrivals[pid].append(int(ev.get("name")))
                except (TypeError, ValueError):
                    pass
        elif ph in ("i", "I") and ev.get("name") == "CYCLE_START":
            cycle_ts.append(ts)
    open_spans = sum(len(s) for s in stacks.values())

    acts: dict[str, Row] = {}
    ops: dict[str, Row] = {}
    tensors: dict[str, TensorRow] = {}
    phase_tensor: dict[str, float] = defaultdict(float)
    phase_iv: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for sp in spans:
        dur = sp.end - sp.start
        trow = tensors.setdefault(sp.tensor, TensorRow(sp.tensor))
        negotiation = sp.name.startswith("NEGOTIATE_")
        if sp.depth == 0 and not negotiation:
            row = ops.setdefault(sp.name, Row(sp.name))
            trow.ops += 1
            trow.op_us += dur
            other = dur - sp.child_us
            if other > 0:
                phase_tensor["other"] += other
            phase_iv["other"].append((sp.start, sp.end))  # trimmed by the union below
        else:
            row = acts.setdefault(sp.name, Row(sp.name))
            cat = category_of(sp.name)
            phase_tensor[cat] += dur
            phase_iv[cat].append((sp.start, sp.end))
            if negotiation:
                trow.negotiations += 1
                trow.negotiate_us += dur
        row.count += 1
        row.total_us += dur
    for tensor, counter in last_ranks.items():
        rank, times = counter.most_common(1)[0]
        tensors[tensor].last_rank, tensors[tensor].last_rank_times = rank, times

    duration = (ts_max - ts_min) if ts_min is not None else 0
    phases: dict[str, dict[str, float]] = {}
    named_wall = _union([iv for cat, ivs in phase_iv.items() if cat != "other" for iv in ivs])
    for cat in PHASES:
        wall = float(_union(phase_iv.get(cat, [])))
        if cat == "other":  # op time outside every named phase
            wall = float(max(0, _union(phase_iv.get("other", []) + [
                iv for c, ivs in phase_iv.items() if c != "other" for iv in ivs]) - named_wall))
        if wall or phase_tensor.get(cat):
            phases[cat] = {"tensor_us": phase_tensor.get(cat, 0.0), "wall_us": wall,
                           "wall_share": wall / duration if duration else 0.0}
    for table in (acts, ops):
        total = sum(r.total_us for r in table.values())
        for r in table.values():
            r.share = r.total_us / total if total else 0.0
    return Summary(
        start_time_since_epoch_in_micros=epoch, duration_us=int(duration),
        cycles=len(cycle_ts), open_spans=open_spans,
        activities=sorted(acts.values(), key=lambda r: -r.total_us),
        operations=sorted(ops.values(), key=lambda r: -r.total_us),
        phases=phases,
        tensors=sorted(tensors.values(), key=lambda t: -(t.op_us + t.negotiate_us)),
        spans=spans, cycle_ts=cycle_ts)


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(s: Summary, top: int = 10) -> str:
    """The text report printed by `summary`."""
    out = [f"Timeline: {_ms(s.duration_us)} ms traced, {len(s.tensors)} tensors, "
           f"{sum(r.count for r in s.operations)} operations, {s.cycles} cycles marked"
           + (f", {s.open_spans} spans still open at the end" if s.open_spans else "")]
    out += ["", "Activities (summed over tensors)", _table(
        ["activity", "count", "total ms", "mean us", "share"],
        [[r.name, r.count, _ms(r.total_us), f"{r.mean_us:.1f}", f"{100 * r.share:.1f}%"]
         for r in s.activities])]
    out += ["", "Operations", _table(
        ["operation", "count", "total ms", "mean us", "share"],
        [[r.name, r.count, _ms(r.total_us), f"{r.mean_us:.1f}", f"{100 * r.share:.1f}%"]
         for r in s.operations])]
    out += ["", "Phases (negotiation wait vs data movement vs copies)", _table(
        ["phase", "tensor-time ms", "wall ms", "wall share"],
        [[p, _ms(v["tensor_us"]), _ms(v["wall_us"]), f"{100 * v['wall_share']:.1f}%"]
         for p, v in s.phases.items()])]
    out += ["", f"Tensors (top {top} by time)", _table(
        ["tensor", "ops", "negotiate ms", "op ms", "mean op us"],
        [[t.name, t.ops, _ms(t.negotiate_us), _ms(t.op_us),
          f"{t.op_us / t.ops:.1f}" if t.ops else "-"] for t in s.tensors[:top]])]
    waits = sorted((t for t in s.tensors if t.negotiations), key=lambda t: -t.negotiate_us)
    out += ["", "Top tensors by negotiation wait", _table(
        ["tensor", "negotiations", "wait ms", "mean wait us", "last rank (times)"],
        [[t.name, t.negotiations, _ms(t.negotiate_us), f"{t.negotiate_us / t.negotiations:.1f}",
          "-" if t.last_rank is None else f"{t.last_rank} ({t.last_rank_times})"]
         for t in waits[:top]])]
    return "\n".join(out)


_COLORS = {"negotiation": "#d62728", "queue/wait": "#ff7f0e", "setup": "#9467bd",
           "copies": "#2ca02c", "data movement": "#1f77b4", "other": "#c7c7c7"}


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: --png needs matplotlib, an optional dependency: "
                         "pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def render_png(s: Summary, out: str, max_tensors: int = 40) -> None:
    """Draws each tensor's phases over time (Gantt) and the wall time per phase.

    Raises:
        SystemExit: matplotlib is not installed.
    """
    plt = _matplotlib()
    order: list[str] = []
    for sp in sorted(s.spans, key=lambda x: x.start):
        if sp.tensor not in order:
            order.append(sp.tensor)
    order = order[:max_tensors]
    row = {t: i for i, t in enumerate(order)}
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(12, 3 + 0.25 * len(order) + 2),
                                 gridspec_kw={"height_ratios": [max(3, len(order)), 3]})
    for sp in s.spans:
        if sp.tensor not in row:
            continue
        top_level = sp.depth == 0 and not sp.name.startswith("NEGOTIATE_")
        cat = "other" if top_level else category_of(sp.name)
        height = 0.8 if top_level else 0.5
        ax.broken_barh([(sp.start / 1000, max(sp.end - sp.start, 1) / 1000)],
                       (row[sp.tensor] - height / 2, height), color=_COLORS[cat], linewidth=0)
    if len(s.cycle_ts) <= 500:
        for ts in s.cycle_ts:
            ax.axvline(ts / 1000, color="#888888", linewidth=0.4, alpha=0.5)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(order, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since timeline start (ms)")
    ax.set_title("Tensor phases" + (" (grey lines: CYCLE_START)" if s.cycle_ts else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="upper right", fontsize=7, ncol=3)
    phases = [p for p in PHASES if p in s.phases]
    bx.barh(phases, [s.phases[p]["wall_us"] / 1000 for p in phases],
            color=[_COLORS[p] for p in phases])
    bx.invert_yaxis()
    bx.set_xlabel("wall time (ms, union over tensors)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
