"""PNG plots of a benchmark report (needs matplotlib; the rest of the report does not).

* ``gemm_<dtype>.png``: GFLOPS against the square size n, one panel per thread
  count, tilegemm / numpy / torch curves and the measured-peak line.
* ``gemm_skinny_<dtype>.png``: bars for the skinny shapes.
* ``conv_<dtype>_<threads>t.png``: per-layer bars, one per algorithm and torch.

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


def _peak_line(ax, peak):
    ax.axhline(peak, color="black", linestyle="--", linewidth=1.2,
               label=f"measured peak ({peak:.0f} GFLOPS)")


def _by_threads(records):
    groups = {}
    for r in records:
        groups.setdefault(r["threads"], []).append(r)
    return dict(sorted(groups.items()))


def plot_gemm_square(records, dtype, path):
    """GFLOPS vs n for the square cases of one dtype; one panel per thread count."""
    groups = _by_threads(records)
    fig, axes = _figure(len(groups))
    for ax, (threads, recs) in zip(axes, groups.items()):
        recs = sorted(recs, key=lambda r: r["n"])
        sizes = [r["n"] for r in recs]
        for party in ("tilegemm", "numpy", "torch"):
            pts = [(r["n"], r["results"][party]["gflops"]) for r in recs if party in r["results"]]
            if pts:
                color, marker = STYLE[party]
                ax.plot(*zip(*pts), color=color, marker=marker, label=party)
        _peak_line(ax, recs[0]["peak_gflops"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_ylim(0, recs[0]["peak_gflops"] * 1.12)
        ax.set_xlabel("matrix size n (n×n times n×n)")
        ax.set_ylabel("GFLOPS (2·n³ / time)")
        ax.set_title(f"GEMM {dtype}, {timing.threads_text(threads)}")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
    fig.savefig(path, dpi=110)


def _bars(ax, categories, series, peak):
    """Grouped bars: ``series`` is {party: [value or None per category]}."""
    width = 0.8 / max(len(series), 1)
    for i, (party, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(categories))]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pts:
            color = STYLE.get(party, ("gray", None))[0]
            ax.bar(*zip(*pts), width=width, color=color, label=_label(party))
    _peak_line(ax, peak)
    ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right")
    ax.set_ylim(0, peak * 1.12)
    ax.grid(True, axis="y", alpha=0.3)
    # Outside the axes, so that it never hides a bar or the peak line.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def plot_gemm_other(records, dtype, path):
    """Bars for the non-square GEMM cases of one dtype; one panel per thread count."""
    groups = _by_threads(records)
    fig, axes = _figure(len(groups))
    for ax, (threads, recs) in zip(axes, groups.items()):
        cats = [f"{r['kind']}\n{r['shape']}" for r in recs]
        parties = [p for p in ("tilegemm", "numpy", "torch") if any(p in r["results"] for r in recs)]
        series = {p: [r["results"].get(p, {}).get("gflops") for r in recs] for p in parties}
        _bars(ax, cats, series, recs[0]["peak_gflops"])
        ax.set_ylabel("GFLOPS (2·m·n·k / time)")
        ax.set_title(f"GEMM {dtype}, skinny shapes, {timing.threads_text(threads)}")
    fig.savefig(path, dpi=110)


def plot_conv(records, dtype, threads, path):
    """Per-layer bars of effective GFLOPS by algorithm, with torch."""
    fig, (ax,) = _figure(1, width=max(8.0, 1.3 * len(records) + 4), height=5.0)
    cats = [r["layer"] for r in records]
    parties = []
    for r in records:
        parties += [p for p in r["results"] if p not in parties]
    order = ["tilegemm:" + a for a in ALGORITHMS] + ["torch"]  # torch last, next to auto
    parties.sort(key=lambda p: order.index(p) if p in order else len(order))
    series = {p: [r["results"].get(p, {}).get("gflops") for r in records] for p in parties}
    _bars(ax, cats, series, records[0]["peak_gflops"])
    ax.set_ylabel("effective GFLOPS (direct-conv flops / time)")
    ax.set_title(f"Convolution {dtype}, batch {records[0]['batch']}, {timing.threads_text(threads)}"
                 "\n(no bar: the algorithm does not apply to the layer)")
    fig.savefig(path, dpi=110)


def write_plots(report, out_dir):
    """Write every plot the report has data for; return file names (relative to out_dir)."""
    written = []
    dtypes = []
    for r in report["gemm"] + report["conv"]["records"]:
        if r["dtype"] not in dtypes:
            dtypes.append(r["dtype"])
    for dtype in dtypes:
        square = [r for r in report["gemm"] if r["dtype"] == dtype and r["kind"] == "square"]
        other = [r for r in report["gemm"] if r["dtype"] == dtype and r["kind"] != "square"]
        if square:
            written.append(f"gemm_{dtype}.png")
            plot_gemm_square(square, dtype, os.path.join(out_dir, written[-1]))
        if other:
            written.append(f"gemm_skinny_{dtype}.png")
            plot_gemm_other(other, dtype, os.path.join(out_dir, written[-1]))
        conv = [r for r in report["conv"]["records"] if r["dtype"] == dtype]
        for threads, recs in _by_threads(conv).items():
            written.append(f"conv_{dtype}_{threads}t.png")
            plot_conv(recs, dtype, threads, os.path.join(out_dir, written[-1]))
    return written
