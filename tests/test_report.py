"""Report contents built from hand-written records: table columns, plot limits and titles.

No measurement runs here; the records are the shape ``bench`` writes to report.json.
"""
import pytest

from tilegemm.tools import report
from tilegemm.tools.conv_suite import ALGORITHMS

matplotlib = pytest.importorskip("matplotlib")
from tilegemm.tools import plots  # noqa: E402  (needs matplotlib)


def party(gflops, ms=(1.0, 1.1, 1.5)):
    low, median, high = (t / 1e3 for t in ms)
    return {"gflops": gflops, "best_s": low, "min_s": low, "median_s": median, "max_s": high,
            "pct_peak": gflops, "ratio": 1.0}


def gemm_record(n, gflops, threads=1):
    return {"op": "gemm", "kind": "square", "shape": f"{n}x{n}x{n}", "n": n, "m": n, "k": n,
            "dtype": "float32", "threads": threads, "peak_gflops": 100.0,
            "results": {"tilegemm": party(gflops), "numpy": party(50.0)},
            "check": {"ok": True}}


def conv_record(layer, winograd_gflops):
    results = {f"tilegemm:{a}": party(60.0) for a in ALGORITHMS}
    results["tilegemm:winograd"] = party(winograd_gflops)
    return {"op": "conv", "layer": layer, "shape": "64->64 3x3/s1 @56x56", "batch": 1,
            "dtype": "float32", "threads": 1, "layout": "NCHW", "peak_gflops": 100.0,
            "results": results, "not_applicable": {}, "check": {}}


def fake_report(gemm=(), conv=()):
    return {"created": "2026-11-26T01:00:00+00:00", "commit": "abc1234", "dirty": True,
            "machine": {"brand": "Test CPU 9000", "isa": "avx2"},
            "gemm": list(gemm), "conv": {"records": list(conv)}}


def ylim_top(fig):
    return max(ax.get_ylim()[1] for ax in fig.axes)


def peak_lines(fig):
    return [line for ax in fig.axes for line in ax.get_lines()
            if line.get_linestyle() == "--" and set(line.get_ydata()) == {100.0}]


def test_conv_plot_is_not_clipped_above_the_peak():
    rep = fake_report(conv=[conv_record("a", 180.0), conv_record("b", 90.0)])
    fig = plots.plot_conv(rep["conv"]["records"], "float32", 1, plots.caption(rep))
    assert ylim_top(fig) > 180.0  # Winograd's effective GFLOPS, far above the peak
    assert peak_lines(fig), "the measured peak is drawn as a dashed line"


def test_gemm_plot_limits_follow_the_data():
    records = [gemm_record(64, 20.0), gemm_record(256, 130.0)]
    fig = plots.plot_gemm_square(records, "float32", "title")
    assert ylim_top(fig) > 130.0 and peak_lines(fig)
    low = plots.plot_gemm_square([gemm_record(64, 20.0)], "float32", "title")
    assert 100.0 < ylim_top(low) < 130.0  # the peak still shows when every value is below it


def test_every_plot_title_names_machine_isa_commit_and_date():
    rep = fake_report(gemm=[gemm_record(64, 20.0)], conv=[conv_record("a", 90.0)])
    title = plots.caption(rep)
    for part in ("Test CPU 9000", "avx2", "abc1234+dirty", "2026-11-26"):
        assert part in title
    figures = [plots.plot_gemm_square(rep["gemm"], "float32", title),
               plots.plot_gemm_other(rep["gemm"], "float32", title),
               plots.plot_conv(rep["conv"]["records"], "float32", 1, title)]
    for fig in figures:
        assert fig.get_suptitle() == title


def test_tables_show_ms_and_the_spread_of_the_repeats():
    (_, headers, rows), = report.gemm_tables([gemm_record(64, 20.0)], has_torch=False)
    cells = dict(zip(headers, rows[0]))
    assert cells["ms"] == "1.000" and cells["min / median / max ms"] == "1 / 1.1 / 1.5"
    (_, headers, rows), = report.conv_tables([conv_record("a", 90.0)], has_torch=False)
    assert all(dict(zip(headers, r))["min / median / max ms"] == "1 / 1.1 / 1.5" for r in rows)
