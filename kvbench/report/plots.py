"""PNG figures of run records: KV memory, external fragmentation and concurrency over time,
latency CDFs, process and device memory, the concurrency-vs-KV-budget sweep and soak retention.

Figures are built with matplotlib's object API on the Agg canvas (no pyplot state), and
every one names its engines, units and run so it reads without the code.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvbench.fileio import write_bytes_atomic
from kvbench.report.labels import engine_labels
from kvbench.results.metric_table import MetricSpec
from kvbench.results.schema import RunRecord, request_column
from kvbench.units import format_bytes

_MIB, _GIB = 2**20, 2**30
# The common engines keep one colour in every figure and page; any other engine's colour
# comes from a hash of its name, so it too is the same in every run.
_ENGINE_COLORS = {"paged": "#1f77b4", "contiguous": "#d62728", "contiguous-request": "#ff7f0e",
                  "vllm": "#2ca02c", "openai": "#9467bd"}
_HASHED_COLORS = ("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939",
                  "#8c6d31", "#843c39", "#7b4173")
_LINE_STYLES = ("-", "--", ":", "-.")
_HATCHES = ("", "//", "..", "xx")  # bars' counterpart of the line styles
_DPI = 110


def engine_color(engine: str) -> str:
    """The colour of ``engine`` in every figure: fixed for the common engines, else a stable
    hash of the name (not Python's ``hash``, which changes per process)."""
    if engine in _ENGINE_COLORS:
        return _ENGINE_COLORS[engine]
    return _HASHED_COLORS[zlib.crc32(engine.encode()) % len(_HASHED_COLORS)]


def engine_styles(engines: Sequence[str]) -> list[tuple[str, str]]:
    """(colour, line style) per engine name: records of one engine share its colour and
    differ by line style (e.g. the same engine at two commits)."""
    seen: dict[str, int] = {}
    out = []
    for engine in engines:
        k = seen[engine] = seen.get(engine, -1) + 1
        out.append((engine_color(engine), _LINE_STYLES[k % len(_LINE_STYLES)]))
    return out


# What each figure shows, for the captions of the pages that embed it.
FIGURE_CAPTIONS = {
    "memory.png": "KV cache memory over run time per engine: bytes holding token states, "
                  "reserved but unused, and free; the black line is the fragmentation index "
                  "(largest free hole / free memory, 1 = all free memory usable).",
    "fragmentation.png": "Free KV memory and its largest hole over run time per engine; red "
                         "marks moments a request waited although enough memory was free "
                         "in total.",
    "concurrency.png": "Requests running (holding KV) and waiting for admission over run "
                       "time, per engine.",
    "latency_cdf.png": "Distributions of time to first token, time per output token and "
                       "end-to-end latency over completed requests, engines overlaid.",
    "process_memory.png": "Process resident memory (RSS) over run time, engines overlaid; "
                          "with CUDA, device memory too.",
    "offload.png": "KV held in each offload tier below device memory over run time, per "
                   "engine with tiers.",
    "sweep.png": "A sweep, per engine: concurrency and output throughput against the KV "
                 "budget, or for block sizes, latency against KV waste and block size.",
    "tables.png": "The tables' metrics as bars: a group per section (suite, workload, "
                  "model), a bar per engine.",
    "soak.png": "KV and process memory left after each soak wave drained, per engine: a "
                "rising line is memory not given back.",
}


def figure_caption(name: str) -> str:
    """The caption of the figure file ``name``: what it shows (its name if unknown)."""
    return FIGURE_CAPTIONS.get(name, name)


def _dense_line(ax: Axes, t: np.ndarray, y: np.ndarray, color: str, label: str,
                ls: str = "-") -> None:
    """``y`` over ``t`` as a line; a series with more points than the axes has pixels is
    drawn as its min-max band per pixel-wide bucket, with the bucket medians as the line,
    since thousands of points per pixel column paint a solid block."""
    fig = ax.get_figure()
    pixels = max(int(fig.get_figwidth() * _DPI * ax.get_position().width), 50)
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    if len(y) <= pixels or t[-1] <= t[0]:
        ax.plot(t, y, color=color, ls=ls, lw=1.0, label=label)
        return
    edges = np.linspace(t[0], t[-1], pixels + 1)
    cuts = np.searchsorted(t, edges[1:-1], side="left")
    groups = [g for g in np.split(np.arange(len(t)), cuts) if len(g)]
    mid = np.array([t[g].mean() for g in groups])
    lo, hi = np.array([y[g].min() for g in groups]), np.array([y[g].max() for g in groups])
    med = np.array([np.median(y[g]) for g in groups])
    ax.fill_between(mid, lo, hi, color=color, alpha=0.25, lw=0, label=f"{label} (min-max)")
    ax.plot(mid, med, color=color, ls=ls, lw=1.0, label=f"{label} (median)")


# Legends beside the axes: stacked areas leave no empty corner inside them.
_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.07, 1.0), "fontsize": 8}


def _unit(max_bytes: float) -> tuple[float, str]:
    return (_GIB, "GiB") if max_bytes >= 4 * _GIB else (_MIB, "MiB")


def _context(rec: RunRecord) -> str:
    return f"{rec.suite} · {rec.workload.name} ({rec.workload.num_requests} requests) · " \
        f"{rec.model.get('name', '?')} on {rec.device}, {rec.clock} clock"


def _figure(rows: int, cols: int = 1, width: float = 10.0, row_height: float = 3.0) -> Figure:
    fig = Figure(figsize=(width, 1.2 + row_height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return write_bytes_atomic(path, buf.getvalue())


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_yticks([])


def plot_memory(records: Sequence[RunRecord], path: Path) -> Path:
    """Per engine: KV memory stacked as used / reserved but unused / free, over run time,
    with the fragmentation index on a second axis."""
    fig = _figure(len(records))
    axes = fig.subplots(len(records), 1, squeeze=False)[:, 0]
    caps = [max(r.curves.get("kv_capacity_bytes") or [r.summary.get("kv_capacity_bytes") or 0])
            for r in records]
    scale, unit = _unit(max(caps, default=0))
    for ax, rec, name in zip(axes, records, engine_labels(records), strict=True):
        c = rec.curves
        if not c.get("kv_reserved_bytes") or not c.get("kv_used_bytes"):
            _no_data(ax, "KV memory")
            ax.set_title(name)
            continue
        t = np.asarray(c["t_s"])
        used = np.asarray(c["kv_used_bytes"]) / scale
        reserved = np.asarray(c["kv_reserved_bytes"]) / scale
        cap = np.asarray(c.get("kv_capacity_bytes") or [rec.summary["kv_capacity_bytes"]] * len(t))
        free = cap / scale - reserved
        ax.stackplot(
            t, used, reserved - used, free,
            labels=("used (token states)", "reserved, unused", "free"),
            colors=("#1f77b4", "#ff7f0e", "#d9d9d9"), step="post",
        )
        ax.set_ylabel(f"KV memory ({unit})")
        ax.set_xlim(t[0] if len(t) == 1 else 0, t[-1])
        if rec.soak:
            for w in rec.soak.per_wave[:-1]:
                ax.axvline(w.t_s, color="black", ls=":", lw=0.8)
        s = rec.summary
        util = s.get("mean_kv_utilization")
        ax.set_title(
            f"{name}: capacity {cap.max() / scale:.3g} {unit}, peak reserved "
            f"{(s.get('peak_kv_reserved_bytes') or 0) / scale:.3g} {unit}"
            + (f", mean utilization {100 * util:.1f}%" if util is not None else ""),
            fontsize=10,
        )
        if c.get("frag_index"):
            twin = ax.twinx()
            _dense_line(twin, t, np.asarray(c["frag_index"]), "black", "fragmentation index")
            twin.set_ylim(0, 1.05)
            twin.set_ylabel("largest free / free")
            handles, names = ax.get_legend_handles_labels()
            h2, n2 = twin.get_legend_handles_labels()
            ax.legend(handles + h2, names + n2, **_OUTSIDE)
        else:
            ax.legend(**_OUTSIDE)
    axes[-1].set_xlabel("run time (s)")
    waves = " (dotted lines: soak waves drained)" if any(r.soak for r in records) else ""
    fig.suptitle(f"KV cache memory over time{waves}\n{_context(records[0])}", fontsize=11)
    return save_png(fig, path)


def plot_fragmentation(records: Sequence[RunRecord], path: Path) -> Path:
    """Per engine: free KV memory and its largest hole over run time, and in red the moments
    when a request was refused although the free memory would have held it in total (no
    hole fit): the request's size as a dot, the moment shaded, the worst one annotated."""
    fig = _figure(len(records), row_height=2.6)
    axes = fig.subplots(len(records), 1, squeeze=False)[:, 0]
    caps = [max(r.curves.get("kv_capacity_bytes") or [r.summary.get("kv_capacity_bytes") or 0])
            for r in records]
    scale, unit = _unit(max(caps, default=0))
    for ax, rec, name, cap in zip(axes, records, engine_labels(records), caps, strict=True):
        c, s = rec.curves, rec.summary
        if not c.get("kv_free_bytes") or not c.get("kv_largest_free_bytes"):
            _no_data(ax, "free KV memory")
            ax.set_title(name)
            continue
        t = np.asarray(c["t_s"])
        free, largest = np.asarray(c["kv_free_bytes"]), np.asarray(c["kv_largest_free_bytes"])
        if np.array_equal(free, largest):
            ax.step(t, free / scale, where="post", color="#1f77b4",
                    label="free = largest free hole")
        else:
            ax.step(t, free / scale, where="post", color="#7f7f7f", label="free")
            ax.step(t, largest / scale, where="post", color="#1f77b4", label="largest free hole")
        waits = np.asarray(c.get("fragmentation_wait_bytes") or np.zeros(len(t)))
        hit = waits > 0
        if hit.any():
            ax.fill_between(t, 0, cap / scale, where=hit, step="post", color="#d62728",
                            alpha=0.12, lw=0)
            ax.plot(t[hit], waits[hit] / scale, ".", color="#d62728", ms=3,
                    label="refused, enough free\n(the request's size)")
        worst_t = s.get("fragmentation_wait_t_s")
        if worst_t is not None:
            need = s["fragmentation_wait_need_bytes"] / scale
            ax.annotate(
                f"t = {worst_t:.1f} s: {s['fragmentation_wait_free_bytes'] / scale:.2f} {unit} "
                f"free, largest hole {s['fragmentation_wait_largest_free_bytes'] / scale:.2f} "
                f"{unit}, request {need:.2f} {unit}",
                (worst_t, need), xytext=(0.5, 0.93), textcoords="axes fraction", ha="center",
                va="top", fontsize=8, arrowprops={"arrowstyle": "->", "color": "#d62728"},
                bbox={"boxstyle": "round", "fc": "white", "ec": "#d62728", "alpha": 0.9},
            )
        wait_s, frag = s.get("fragmentation_wait_s"), s.get("min_frag_index")
        facts = [f"min fragmentation index {frag:.2f}"] if frag is not None else []
        if wait_s is not None:
            share = f" ({100 * wait_s / s['duration_s']:.0f}% of the run)" \
                if wait_s and s.get("duration_s") else ""
            facts.append(f"{wait_s:.1f} s{share} waiting with enough KV free")
        ax.set_title(f"{name}: " + "; ".join(facts) if facts else name, fontsize=10)
        ax.set_ylabel(f"KV memory ({unit})")
        ax.set_ylim(0, cap / scale * 1.05 if cap else None)
        ax.set_xlim(t[0] if len(t) == 1 else 0, t[-1])
        ax.legend(**_OUTSIDE)
    axes[-1].set_xlabel("run time (s)")
    fig.suptitle("External fragmentation: free memory vs the largest hole; red, a request "
                 f"waited although enough was free in total\n{_context(records[0])}",
                 fontsize=11)
    return save_png(fig, path)


def plot_concurrency(records: Sequence[RunRecord], path: Path) -> Path:
    """Per engine: requests running (holding KV) and waiting for admission, over run time."""
    fig = _figure(len(records), row_height=2.6)
    axes = fig.subplots(len(records), 1, squeeze=False)[:, 0]
    for ax, rec, name in zip(axes, records, engine_labels(records), strict=True):
        c = rec.curves
        if not c.get("running"):
            _no_data(ax, "queue sizes")
            ax.set_title(name)
            continue
        t = c["t_s"]
        ax.step(t, c["running"], where="post", color="#1f77b4", label="running (holding KV)")
        ax.step(t, c["waiting"], where="post", color="#d62728", label="waiting")
        s = rec.summary
        ax.set_title(
            f"{name}: max {s.get('max_concurrent_requests')} running, mean "
            f"{s.get('mean_concurrent_requests') or 0:.1f}, {s.get('preemptions', 0)} preemptions",
            fontsize=10,
        )
        ax.set_ylabel("requests")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("run time (s)")
    fig.suptitle(f"Concurrency over time\n{_context(records[0])}", fontsize=11)
    return save_png(fig, path)


_LATENCIES = (
    ("ttft_ms", "time to first token", "ttft_ms"),
    ("tpot_ms", "time per output token", "tpot_ms"),
    ("e2el_ms", "end-to-end latency", "e2el_ms"),
)


_CDF_POINTS = 20_000


def plot_latency_cdfs(records: Sequence[RunRecord], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2EL over completed requests, engines overlaid."""
    fig = _figure(1, width=14.0, row_height=3.6)
    axes = fig.subplots(1, len(_LATENCIES), squeeze=False)[0]
    names = engine_labels(records)
    styles = engine_styles([r.engine for r in records])
    for ax, (field, title, slo_key) in zip(axes, _LATENCIES, strict=True):
        drawn = []
        for (color, ls), rec, name in zip(styles, records, names, strict=True):
            values = np.sort([v for v in request_column(rec.requests, field) if v is not None])
            if len(values) == 0:
                continue
            # Past _CDF_POINTS requests, the CDF at evenly spaced ranks (the last included).
            ranks = np.unique(np.linspace(0, len(values) - 1, min(len(values), _CDF_POINTS))
                              .round().astype(np.int64))
            ax.step(values[ranks], (ranks + 1) / len(values), where="post",
                    color=color, ls=ls, label=name)
            drawn.append(values)
        limit = getattr(records[0].slo, slo_key, None) if records[0].slo else None
        if limit is not None:
            ax.axvline(limit, color="gray", ls="--", lw=1, label=f"SLO {limit:g} ms")
        if not drawn:
            _no_data(ax, title)
        else:
            lo = min(float(v[v > 0].min()) for v in drawn if (v > 0).any()) if any(
                (v > 0).any() for v in drawn) else 1.0
            hi = max(float(v.max()) for v in drawn)
            if hi / max(lo, 1e-9) > 100:
                ax.set_xscale("log")
            if limit is not None:
                ax.legend(handles=ax.lines[-1:], loc="lower right", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("fraction of completed requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    # One legend for the three panels: the engines are the same in each.
    handles = {line.get_label(): line for ax in axes for line in ax.lines[: len(records)]
               if not line.get_label().startswith("SLO")}
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncols=min(len(handles), 3), fontsize=9)
    fig.suptitle(f"Latency distributions (CDF over completed requests; the median is where "
                 f"a curve crosses 0.5)\n{_context(records[0])}", fontsize=11)
    return save_png(fig, path)


_DEVICE_CURVES = (
    ("cuda_allocated_bytes", "allocated (torch)"),
    ("cuda_reserved_bytes", "reserved (torch allocator)"),
    ("nvml_process_used_bytes", "process (NVML)"),
)


def plot_process_memory(records: Sequence[RunRecord], path: Path) -> Path:
    """Process RSS and, on CUDA, device memory over run time, engines overlaid."""
    has_device = any(k in r.curves for r in records for k, _ in _DEVICE_CURVES)
    fig = _figure(2 if has_device else 1, row_height=3.0)
    axes = fig.subplots(2 if has_device else 1, 1, squeeze=False)[:, 0]
    names = engine_labels(records)
    styles = engine_styles([r.engine for r in records])
    peak = max((max(r.curves.get("rss_bytes") or [0]) for r in records), default=0)
    scale, unit = _unit(peak)
    ax = axes[0]
    for (color, ls), rec, name in zip(styles, records, names, strict=True):
        if rec.curves.get("rss_bytes"):
            # Records from before probes shared the step axis carry their own RSS times.
            t = rec.curves.get("rss_t_s", rec.curves["t_s"])
            _dense_line(ax, np.asarray(t), np.asarray(rec.curves["rss_bytes"]) / scale,
                        color, name, ls)
    ax.set_title("process resident memory (RSS)", fontsize=10)
    ax.set_ylabel(f"RSS ({unit})")
    if ax.lines:
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax, "RSS")
    if has_device:
        ax = axes[1]
        peak = max(max(r.curves.get(k) or [0]) for r in records for k, _ in _DEVICE_CURVES)
        scale, unit = _unit(peak)
        kinds = ("-", "--", ":")
        for (color, _), rec, name in zip(styles, records, names, strict=True):
            for (key, what), ls in zip(_DEVICE_CURVES, kinds, strict=True):
                if rec.curves.get(key):
                    _dense_line(ax, np.asarray(rec.curves["t_s"]),
                                np.asarray(rec.curves[key]) / scale, color, f"{name}: {what}",
                                ls)
        ax.set_title("device memory", fontsize=10)
        ax.set_ylabel(f"device memory ({unit})")
        ax.legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("run time (s)")
    # Titled by what is drawn: device memory only where some record has it.
    what = "Process and device memory" if has_device else "Process resident memory (RSS)"
    fig.suptitle(f"{what} over time\n{_context(records[0])}", fontsize=11)
    return save_png(fig, path)


def plot_sweep(records: Sequence[RunRecord], path: Path) -> Path:
    """Concurrency and throughput against the KV budget, one line per engine."""
    by_engine: dict[str, list[RunRecord]] = {}
    for rec in records:
        by_engine.setdefault(rec.engine, []).append(rec)
    budgets = [r.summary.get("kv_capacity_bytes") or 0 for r in records]
    fig = _figure(1, width=13.0, row_height=4.0)
    ax_c, ax_t = fig.subplots(1, 2, squeeze=False)[0]
    for engine, recs in by_engine.items():
        recs = sorted(recs, key=lambda r: r.summary.get("kv_capacity_bytes") or 0)
        x = [r.summary.get("kv_capacity_bytes") or 0 for r in recs]
        color = engine_color(engine)
        ax_c.plot(x, [r.summary.get("max_concurrent_requests") for r in recs], "o-",
                  color=color, label=f"{engine}: max")
        ax_c.plot(x, [r.summary.get("mean_concurrent_requests") for r in recs], "s--",
                  color=color, alpha=0.7, label=f"{engine}: time-weighted mean")
        ax_t.plot(x, [r.summary.get("output_throughput") for r in recs], "o-", color=color,
                  label=engine)
    ticks = sorted({b for b in budgets if b})
    for ax in (ax_c, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [format_bytes(b) for b in ticks])
        ax.minorticks_off()
        ax.set_xlabel("KV cache budget (log scale)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    ax_c.set_ylabel("concurrent requests (holding KV)")
    ax_c.set_title("concurrency vs KV budget", fontsize=10)
    ax_t.set_ylabel("output tokens / s")
    ax_t.set_title("output throughput vs KV budget", fontsize=10)
    fig.suptitle(f"KV budget sweep\n{_context(records[0])}", fontsize=11)
    return save_png(fig, path)


def plot_block_sweep(records: Sequence[RunRecord], path: Path) -> Path:
    """Latency against memory across block sizes (one line per engine, points labelled by
    block size), and each against the block size."""
    by_engine: dict[str, list[tuple[int, RunRecord]]] = {}
    for rec in records:
        size = rec.engine_config.get("block_size")
        if isinstance(size, int):
            by_engine.setdefault(rec.engine, []).append((size, rec))
    fig = _figure(1, width=16.0, row_height=4.2)
    ax_t, ax_l, ax_w = fig.subplots(1, 3, squeeze=False)[0]
    sizes = sorted({size for recs in by_engine.values() for size, _ in recs})
    for engine, recs in by_engine.items():
        recs.sort(key=lambda sr: sr[0])
        color = engine_color(engine)
        xs = [sr[0] for sr in recs]

        def col(name: str, rs: list[tuple[int, RunRecord]] = recs) -> list[float]:
            return [np.nan if (v := r.summary.get(name)) is None else float(v) for _, r in rs]

        # What a block size costs in memory: the reserved share its rounding leaves empty
        # (a pool under load is full at any block size, so its peak tells nothing).
        mem, tpot = col("kv_waste_pct"), col("median_tpot_ms")
        ax_t.plot(mem, tpot, "o-", color=color, label=engine)
        for size, x, y in zip(xs, mem, tpot, strict=True):
            ax_t.annotate(str(size), (x, y), textcoords="offset points", xytext=(4, 4),
                          fontsize=7, color=color)
        ax_l.plot(xs, tpot, "o-", color=color, label=f"{engine}: TPOT p50")
        ax_l.plot(xs, col("median_ttft_ms"), "s--", color=color, alpha=0.7,
                  label=f"{engine}: TTFT p50")
        ax_w.plot(xs, col("max_concurrent_requests"), "o-", color=color, label=engine)
    ax_t.set_xlabel("KV waste % (reserved memory holding no KV)")
    ax_t.set_ylabel("TPOT p50 (ms)")
    ax_t.set_title("latency vs memory (labels: block size in tokens)", fontsize=10)
    for ax in (ax_l, ax_w):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens, log scale)")
    ax_l.set_ylabel("ms")
    ax_l.set_yscale("log")
    ax_l.set_title("latency vs block size", fontsize=10)
    ax_w.set_ylabel("max concurrent requests")
    ax_w.set_title("concurrency vs block size", fontsize=10)
    ax_w.set_ylim(bottom=0)
    for ax in (ax_t, ax_l, ax_w):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"block-size sweep: the latency-vs-memory trade-off\n{_context(records[0])}",
                 fontsize=11)
    return save_png(fig, path)


def plot_metric_bars(
    sections: Sequence[tuple[str, Sequence[RunRecord], Sequence[str]]],
    metrics: Sequence[MetricSpec], path: Path,
) -> Path:
    """One panel per metric: a group of bars per section (suite, workload, model), a bar per
    labelled record (``sections`` hold a title, records and their labels). Records of one
    engine share its colour and differ by hatching. A metric spanning more than two decades
    is drawn on a log scale."""
    bars = list(dict.fromkeys((lab, r.engine) for _, recs, labs in sections
                              for r, lab in zip(recs, labs, strict=True)))
    styles = engine_styles([engine for _, engine in bars])
    cols = 2
    rows = -(-len(metrics) // cols)
    fig = _figure(rows, width=8.0 * cols, row_height=3.2)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    width = 0.8 / max(len(bars), 1)
    x = np.arange(len(sections))
    for ax, spec in zip(axes, metrics, strict=False):
        values = []
        for j, ((label, _), (color, style)) in enumerate(zip(bars, styles, strict=True)):
            ys = []
            for _, recs, labs in sections:
                v = next((r.summary.get(spec.name) for r, lab in zip(recs, labs, strict=True)
                          if lab == label), None)
                ys.append(np.nan if v is None else float(v))
            values += [y for y in ys if np.isfinite(y) and y > 0]
            ax.bar(x + (j - (len(bars) - 1) / 2) * width, ys, width, color=color,
                   hatch=_HATCHES[_LINE_STYLES.index(style)], label=label)
        if values and max(values) / min(values) > 100:
            ax.set_yscale("log")
        ax.set_title(f"{spec.label} ({spec.unit})" if spec.unit else spec.label, fontsize=9)
        ax.set_xticks(x, [name for name, _, _ in sections], rotation=30, ha="right", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7, ncols=min(len(bars), 4))
    first = sections[0][1][0]
    fig.suptitle(f"{first.suite}: {len(bars)} runs on {first.device}, {first.clock} "
                 "clock", fontsize=11)
    return save_png(fig, path)


def plot_soak(records: Sequence[RunRecord], path: Path) -> Path:
    """KV and process memory left after each soak wave drained, per engine."""
    soaks = [(r, n) for r, n in zip(records, engine_labels(records), strict=True) if r.soak]
    kinds = [("kv_reserved_bytes", "KV reserved after drain"), ("rss_bytes", "process RSS"),
             ("cuda_reserved_bytes", "torch allocator reserved"),
             ("nvml_device_used_bytes", "device used (NVML)")]
    kinds = [k for k in kinds if any(k[0] in w.memory for r, _ in soaks for w in r.soak.per_wave)]
    fig = _figure(1, width=5.0 * max(len(kinds), 1), row_height=3.6)
    axes = fig.subplots(1, max(len(kinds), 1), squeeze=False)[0]
    for ax, (kind, title) in zip(axes, kinds, strict=False):
        peak = max((w.memory.get(kind, 0) for r, _ in soaks for w in r.soak.per_wave), default=0)
        scale, unit = _unit(peak)
        styles = engine_styles([r.engine for r, _ in soaks])
        for (color, ls), (rec, name) in zip(styles, soaks, strict=True):
            waves = [w for w in rec.soak.per_wave if kind in w.memory]
            fit = rec.soak.fits.get(kind)
            verdict = ""
            if fit is not None:
                slope = f"{fit.bytes_per_wave / _MIB:+.2f} MiB/wave"
                verdict = f" — {'LEAK' if fit.leak else 'ok'}, {slope}"
            ax.plot([w.wave for w in waves], [w.memory[kind] / scale for w in waves], marker="o",
                    color=color, ls=ls, label=name + verdict)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("wave (memory read after it drained)")
        ax.set_ylabel(unit)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if not kinds:
        _no_data(axes[0], "soak wave")
    fig.suptitle(f"Memory retained per soak wave\n{_context(records[0])}", fontsize=11)
    return save_png(fig, path)


_TIER_COLORS = {"cpu": "#1f77b4", "cxl": "#2ca02c", "disk": "#8c564b"}


def plot_offload(records: Sequence[RunRecord], path: Path) -> Path | None:
    """Per engine with offload tiers: the KV each tier holds over run time (None, and no
    figure, where no engine has tiers)."""
    tiered = [(rec, name) for rec, name in zip(records, engine_labels(records), strict=True)
              if any(f"offload_{k}_used_bytes" in rec.curves for k in _TIER_COLORS)]
    if not tiered:
        return None
    fig = _figure(len(tiered), row_height=2.6)
    axes = fig.subplots(len(tiered), 1, squeeze=False)[:, 0]
    peak = max(max(rec.curves.get(f"offload_{k}_used_bytes") or [0]) for rec, _ in tiered
               for k in _TIER_COLORS)
    scale, unit = _unit(peak)
    for ax, (rec, name) in zip(axes, tiered, strict=True):
        t = np.asarray(rec.curves["t_s"])
        for kind, color in _TIER_COLORS.items():
            used = rec.curves.get(f"offload_{kind}_used_bytes")
            if used:
                _dense_line(ax, t, np.asarray(used) / scale, color, f"{kind} tier")
        rate = rec.summary.get("offload_hit_rate")
        ax.set_title(f"{name}: {100 * (rate or 0):.1f}% of prompt tokens served from below "
                     "device memory", fontsize=10)
        ax.set_ylabel(f"KV held ({unit})")
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("run time (s)")
    fig.suptitle(f"KV held in offload tiers over time\n{_context(records[0])}", fontsize=11)
    return save_png(fig, path)


RUN_PLOTS: tuple[tuple[str, Callable[[Sequence[RunRecord], Path], Path | None]], ...] = (
    ("memory.png", plot_memory),
    ("fragmentation.png", plot_fragmentation),
    ("concurrency.png", plot_concurrency),
    ("latency_cdf.png", plot_latency_cdfs),
    ("process_memory.png", plot_process_memory),
    ("offload.png", plot_offload),
)


def write_plots(
    records: Sequence[RunRecord],
    out_dir: Path,
    extra: Sequence[tuple[str, Callable[[Sequence[RunRecord], Path], Path | None]]] = (),
) -> tuple[list[Path], list[str]]:
    """Write every figure that applies (a plot returns None where nothing does); one failing
    figure does not stop the others. Returns the written paths and a message per failure."""
    written: list[Path] = []
    errors: list[str] = []
    if not records:
        return written, errors
    for name, plot in (*RUN_PLOTS, *extra):
        try:
            if (figure := plot(records, out_dir / name)) is not None:
                written.append(figure)
        except Exception as exc:
            errors.append(f"plot {name} failed: {type(exc).__name__}: {exc}")
    return written, errors
