"""PNG plots of a benchmark report (needs matplotlib; the rest of the report does not).

* ``gemm_<dtype>.png``: GFLOPS against the square size n, one panel per thread
  count, tilegemm / numpy / torch curves and the measured-peak line.
* ``gemm_skinny_<dtype>.png``: bars for the skinny shapes.
* ``conv_<dtype>_<threads>t.png``: per-layer bars, one per algorithm and peer
  (numpy's explicit im2col, torch).
* ``roofline_<dtype>.png``: every GEMM and layer at its arithmetic intensity under
  the measured peak and memory bandwidth, log-log, one panel per thread count.

Every title names the machine (CPU model, ISA), the commit and the date; the
y-axis reaches above the largest value plotted, so nothing is clipped (Winograd's
effective GFLOPS can exceed the peak), and the measured peak is a dashed line.
Figures are drawn with matplotlib's object API on an Agg canvas, so no GUI
backend or global pyplot state is involved.
"""
import os

from tilegemm.tools import timing
from tilegemm.tools.conv_suite import ALGORITHMS

PLOTS_SKIPPED = ("Plots skipped: matplotlib is not installed. Install it with "
                 "`pip install matplotlib` (or `pip install -e .[bench]`) and run again.")

#: One colour and marker per party, the same in every figure.
STYLE = {
    "tilegemm": ("tab:blue", "o"), "numpy": ("tab:orange", "s"), "torch": ("tab:green", "^"),
    "tilegemm:im2col": ("tab:blue", None), "tilegemm:winograd": ("tab:purple", None),
    "tilegemm:direct": ("tab:cyan", None), "tilegemm:auto": ("navy", None),
    # Winograd per output tile size (conv_suite.winograd_label).
    "tilegemm:winograd F(2x2)": ("plum", None), "tilegemm:winograd F(4x4)": ("tab:purple", None),
    "tilegemm:winograd F(6x6)": ("indigo", None),
}


def matplotlib_available():
    return timing.optional_import("matplotlib") is not None


def _figure(ncols, width=6.4, height=4.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _label(name):
    return name.replace("tilegemm:", "tilegemm ")


def _peak_line(ax, peak, values):
    """The measured-peak line, and a y-range that holds it and every value."""
    ax.axhline(peak, color="black", linestyle="--", linewidth=1.2,
               label=f"measured peak ({peak:.0f} GFLOPS)")
    top = max([peak] + [v for v in values if v is not None])
    ax.set_ylim(0, top * 1.1)


def caption(report):
    """Machine, ISA, commit and date of a report, for the figure titles."""
    from tilegemm.tools.provenance import commit_text
    m = report.get("machine") or {}
    source = {"commit": report["commit"], "dirty": report["dirty"]} if report.get(
        "commit") else None
    return (f"{m.get('brand', 'unknown CPU')}, {m.get('isa', '?')}; commit "
            f"{commit_text(source)}; {report['created'][:10]}")


def _by_threads(records):
    groups = {}
    for r in records:
        groups.setdefault(r["threads"], []).append(r)
    return dict(sorted(groups.items()))


def plot_gemm_square(records, dtype, title):
    """GFLOPS vs n for the square cases of one dtype; one panel per thread count.

    Returns the matplotlib Figure; ``title`` (e.g. :func:`caption`) goes on top.
    """
    groups = _by_threads(records)
    fig, axes = _figure(len(groups))
    fig.suptitle(title, fontsize="medium")
    for ax, (threads, recs) in zip(axes, groups.items()):
        recs = sorted(recs, key=lambda r: r["n"])
        sizes = [r["n"] for r in recs]
        for party in ("tilegemm", "numpy", "torch"):
            pts = [(r["n"], r["results"][party]["gflops"]) for r in recs if party in r["results"]]
            if pts:
                color, marker = STYLE[party]
                ax.plot(*zip(*pts), color=color, marker=marker, label=party)
        _peak_line(ax, recs[0]["peak_gflops"],
                   [p["gflops"] for r in recs for p in r["results"].values()])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("matrix size n (n×n times n×n)")
        ax.set_ylabel("GFLOPS (2·n³ / time)")
        ax.set_title(f"GEMM {dtype}, {timing.threads_text(threads)}")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
    return fig


def _bars(ax, categories, series, peak):
    """Grouped bars: ``series`` is {party: [value or None per category]}."""
    width = 0.8 / max(len(series), 1)
    for i, (party, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(categories))]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pts:
            color = STYLE.get(party, ("gray", None))[0]
            ax.bar(*zip(*pts), width=width, color=color, label=_label(party))
    _peak_line(ax, peak, [v for values in series.values() for v in values])
    ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right")
    ax.grid(True, axis="y", alpha=0.3)
    # Outside the axes, so that it never hides a bar or the peak line.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def plot_gemm_other(records, dtype, title):
    """Bars for the non-square GEMM cases of one dtype, one panel per thread count: a Figure."""
    groups = _by_threads(records)
    fig, axes = _figure(len(groups))
    fig.suptitle(title, fontsize="medium")
    for ax, (threads, recs) in zip(axes, groups.items()):
        cats = [f"{r['kind']}\n{r['shape']}" for r in recs]
        parties = [p for p in ("tilegemm", "numpy", "torch") if any(p in r["results"] for r in recs)]
        series = {p: [r["results"].get(p, {}).get("gflops") for r in recs] for p in parties}
        _bars(ax, cats, series, recs[0]["peak_gflops"])
        ax.set_ylabel("GFLOPS (2·m·n·k / time)")
        ax.set_title(f"GEMM {dtype}, skinny shapes, {timing.threads_text(threads)}")
    return fig


def plot_conv(records, dtype, threads, title):
    """Per-layer bars of effective GFLOPS by algorithm, with the peers: a Figure."""
    fig, (ax,) = _figure(1, width=max(8.0, 1.3 * len(records) + 4), height=5.0)
    fig.suptitle(title, fontsize="medium")
    cats = [r["layer"] for r in records]
    parties = []
    for r in records:
        parties += [p for p in r["results"] if p not in parties]
    order = ["tilegemm:" + a for a in ALGORITHMS] + ["numpy", "torch"]  # peers next to auto
    # Winograd's tile sizes ("tilegemm:winograd F(4x4)") sit where winograd does.
    parties.sort(key=lambda p: (order.index(p.split(" F(")[0]) if p.split(" F(")[0] in order
                                else len(order), p))
    series = {p: [r["results"].get(p, {}).get("gflops") for r in records] for p in parties}
    _bars(ax, cats, series, records[0]["peak_gflops"])
    ax.set_ylabel("effective GFLOPS (direct-conv flops / time)")
    ax.set_title(f"Convolution {dtype}, batch {records[0]['batch']}, {timing.threads_text(threads)}"
                 "\n(no bar: the algorithm does not apply to the layer)")
    return fig


def intensity(record):
    """Arithmetic intensity of a GEMM or convolution record: flops / minimal bytes moved.

    The minimal bytes are every input and the output once (GEMM: (m·k + k·n + m·n)
    elements per product of a batch; convolution: the record's ``min_bytes``); None when the record does
    not say (reports from before the roofline).
    """
    if record.get("op") == "gemm":
        item = 4 if record["dtype"] == "float32" else 8
        m, n, k = record["m"], record["n"], record["k"]
        return record["flops"] / ((m * k + k * n + m * n) * item * record.get("batch", 1))
    return record["flops"] / record["min_bytes"] if record.get("min_bytes") else None


def roofline_points(records):
    """[(label, intensity, GFLOPS)]: tilegemm's figure of each GEMM and convolution record.

    Convolutions give ``algorithm="auto"`` (else their fastest algorithm) in
    effective GFLOPS, so Winograd can sit above the roof.
    """
    points = []
    for r in records:
        ai = intensity(r)
        ours = {n: p for n, p in r["results"].items() if n.startswith("tilegemm")}
        if ai is None or not ours:
            continue
        best = ours.get("tilegemm", ours.get("tilegemm:auto")) or max(
            ours.values(), key=lambda p: p["gflops"])
        label = r["shape"] if r.get("op") == "gemm" else r["layer"]
        points.append((label, ai, best["gflops"]))
    return points


def plot_roofline(panels, bandwidth_gbps, title):
    """Roofline: measured peak and memory bandwidth, each case at its intensity: a Figure.

    Parameters
    ----------
    panels : list of (subtitle, peak GFLOPS, points)
        One log-log panel each; ``points`` as :func:`roofline_points` gives them.
    bandwidth_gbps : float
        Measured memory bandwidth: the sloped roof is ``bandwidth × intensity``.
    """
    fig, axes = _figure(len(panels))
    fig.suptitle(title, fontsize="medium")
    for ax, (subtitle, peak, points) in zip(axes, panels):
        ais = [p[1] for p in points] or [1.0]
        lo, hi = min(ais + [peak / bandwidth_gbps]) / 4, max(ais + [peak / bandwidth_gbps]) * 4
        ridge = peak / bandwidth_gbps
        ax.plot([lo, ridge], [bandwidth_gbps * lo, peak], color="black", linewidth=1.2,
                label=f"measured bandwidth ({bandwidth_gbps:.1f} GB/s)")
        ax.plot([ridge, hi], [peak, peak], color="black", linestyle="--", linewidth=1.2,
                label=f"measured peak ({peak:.0f} GFLOPS)")
        for label, ai, gf in points:
            ax.scatter([ai], [gf], s=22, zorder=3)
            ax.annotate(label, (ai, gf), fontsize="x-small", xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_xlabel("arithmetic intensity (flops / byte of inputs and output once)")
        ax.set_ylabel("GFLOPS (convolution: effective)")
        ax.set_title(subtitle)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    return fig


def _roofline(report, dtype, title):
    """The roofline figure of ``dtype`` (one panel per thread count), or None."""
    bandwidth = (report.get("memory_bandwidth") or {}).get("gbps")
    records = [r for r in report["gemm"] + report["conv"]["records"] if r["dtype"] == dtype]
    panels = [(f"{dtype}, {timing.threads_text(t)}", recs[0]["peak_gflops"], roofline_points(recs))
              for t, recs in _by_threads(records).items() if recs[0]["peak_gflops"]]
    panels = [p for p in panels if p[2]]
    return plot_roofline(panels, bandwidth, title) if bandwidth and panels else None


def write_plots(report, out_dir):
    """Write every plot the report has data for; return file names (relative to out_dir)."""
    written, dtypes, title = [], [], caption(report)

    def save(name, fig):
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        written.append(name)

    for r in report["gemm"] + report["conv"]["records"]:
        if r["dtype"] not in dtypes:
            dtypes.append(r["dtype"])
    for dtype in dtypes:
        square = [r for r in report["gemm"] if r["dtype"] == dtype and r["kind"] == "square"]
        other = [r for r in report["gemm"] if r["dtype"] == dtype and r["kind"] != "square"]
        if square:
            save(f"gemm_{dtype}.png", plot_gemm_square(square, dtype, title))
        if other:
            save(f"gemm_skinny_{dtype}.png", plot_gemm_other(other, dtype, title))
        conv = [r for r in report["conv"]["records"] if r["dtype"] == dtype]
        for threads, recs in _by_threads(conv).items():
            save(f"conv_{dtype}_{threads}t.png", plot_conv(recs, dtype, threads, title))
        roof = _roofline(report, dtype, title)
        if roof is not None:
            save(f"roofline_{dtype}.png", roof)
    return written
