"""Report contents built from hand-written records: table columns, plot limits and titles.

No measurement runs here; the records are the shape ``bench`` writes to report.json.
"""
import numpy as np
import pytest

from tilegemm.tools import report, timing
from tilegemm.tools.conv_suite import (ALGORITHMS, AUTO_WITHIN, auto_result, im2col_numpy,
                                      mark_auto, screen, split_algorithm, winograd_label)


@pytest.fixture
def plots():
    """tilegemm.tools.plots, whose figures need matplotlib (an optional package)."""
    pytest.importorskip("matplotlib")
    from tilegemm.tools import plots
    return plots


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


def test_conv_plot_is_not_clipped_above_the_peak(plots):
    rep = fake_report(conv=[conv_record("a", 180.0), conv_record("b", 90.0)])
    fig = plots.plot_conv(rep["conv"]["records"], "float32", 1, plots.caption(rep))
    assert ylim_top(fig) > 180.0  # Winograd's effective GFLOPS, far above the peak
    assert peak_lines(fig), "the measured peak is drawn as a dashed line"


def test_gemm_plot_limits_follow_the_data(plots):
    records = [gemm_record(64, 20.0), gemm_record(256, 130.0)]
    fig = plots.plot_gemm_square(records, "float32", "title")
    assert ylim_top(fig) > 130.0 and peak_lines(fig)
    low = plots.plot_gemm_square([gemm_record(64, 20.0)], "float32", "title")
    assert 100.0 < ylim_top(low) < 130.0  # the peak still shows when every value is below it


def test_every_plot_title_names_machine_isa_commit_and_date(plots):
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
    (_, headers, rows), = report.conv_tables([conv_record("a", 90.0)])
    assert all(dict(zip(headers, r))["min / median / max ms"] == "1 / 1.1 / 1.5" for r in rows)


def direct_conv(x, w, stride, padding, groups):
    """The definition, as loops over output positions (float64, NCHW)."""
    n, c, h, wd = x.shape
    k, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    ho, wo = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    out = np.zeros((n, k, ho, wo))
    kg = k // groups
    for oc in range(k):
        g = oc // kg
        for i in range(ho):
            for j in range(wo):
                patch = xp[:, g * cg:(g + 1) * cg, i * stride:i * stride + kh,
                           j * stride:j * stride + kw]
                out[:, oc, i, j] = np.einsum("nchw,chw->n", patch, w[oc])
    return out


@pytest.mark.parametrize("stride, padding, groups", [(1, 1, 1), (2, 1, 1), (1, 0, 3), (2, 2, 6)])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_numpy_im2col_peer_is_a_convolution(stride, padding, groups, layout):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 7, 9))
    w = rng.standard_normal((12, 6 // groups, 3, 3))
    expected = direct_conv(x, w, stride, padding, groups)
    if layout == "NHWC":
        x, expected = x.transpose(0, 2, 3, 1).copy(), expected.transpose(0, 2, 3, 1)
    got = im2col_numpy(x, w, stride, padding, groups, layout)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_conv_tables_show_the_numpy_peer():
    rec = conv_record("a", 90.0)
    rec["results"]["numpy"] = party(30.0)
    for name in rec["results"]:
        if name.startswith("tilegemm"):
            rec["results"][name]["ratio_numpy"] = rec["results"][name]["gflops"] / 30.0
    (_, headers, rows), = report.conv_tables([rec])
    assert "numpy GFLOPS" in headers and "torch GFLOPS" not in headers
    winograd = [dict(zip(headers, r)) for r in rows if r[3] == "winograd"][0]
    assert winograd["numpy GFLOPS"] == "30.0" and winograd["× numpy"] == "3.00×"


def test_screen_leaves_out_algorithms_far_slower_than_the_best():
    estimates = {"im2col": 1.0e-3, "winograd": 0.8e-3, "direct": 40e-3}
    assert screen(estimates, "estimated") == {
        "direct": "skipped, estimated 50x slower than winograd"}
    assert screen(estimates, "estimated", keep=("direct",)) == {}  # what auto picks stays
    measured = {"im2col": 1.0e-3, "direct": 7.9e-3}               # within 8x: timed
    assert screen(measured, "measured") == {} and screen({}, "measured") == {}
    assert screen({"im2col": 1e-3, "direct": 9e-3}, "measured") == {
        "direct": "skipped, measured 9x slower than im2col"}


def test_auto_row_is_the_chosen_algorithms_measurement():
    fake = {"tilegemm:im2col": timing.Timing(0.5, 1, [2.0e-3, 2.2e-3]),
            "tilegemm:winograd": timing.Timing(0.6, 1, [1.0e-3, 1.3e-3, 1.1e-3])}
    results = timing.summarise(fake, flops=2e9, peak=100.0)
    auto = auto_result(results, "winograd")
    assert auto["samples_s"] == [1.0e-3, 1.3e-3, 1.1e-3] and auto["gflops"] == 2000.0
    assert auto["chose"] == "winograd" and auto["timed_as"] == "tilegemm:winograd"
    assert "chose" not in results["tilegemm:winograd"]  # a copy: the winograd row is unchanged
    assert auto_result(results, "direct") is None


def test_winograd_tiles_are_parties_of_their_own():
    assert winograd_label(4) == "winograd F(4x4)"
    assert split_algorithm(winograd_label(6)) == ("winograd", 6)
    assert split_algorithm("winograd") == ("winograd", None)
    assert split_algorithm("im2col") == ("im2col", None)


def test_auto_is_held_against_the_fastest_algorithm_timed():
    rec = conv_record("fast", 90.0)
    rec["results"]["tilegemm:winograd F(4x4)"] = party(120.0)
    auto = mark_auto(rec["results"], dict(rec["results"]["tilegemm:winograd"], chose="winograd"))
    assert auto["best"] == "winograd F(4x4)" and auto["vs_best"] == pytest.approx(0.75)
    rec["results"]["tilegemm:auto"] = auto
    good = conv_record("good", 90.0)
    good["results"]["tilegemm:auto"] = mark_auto(
        good["results"], dict(good["results"]["tilegemm:winograd"], chose="winograd"))
    lines = report.auto_summary([rec, good, conv_record("old", 90.0)])  # old: no vs_best
    assert lines[0].startswith(f"`auto` within {100 * (1 - AUTO_WITHIN):.0f}% of the fastest")
    assert "on 1 of 2 layers; not on:" in lines[0]
    assert lines[1:] == ["fast (float32, 1 thread): auto → winograd at 0.75x of "
                         "winograd F(4x4)"]
    assert report.auto_summary([conv_record("old", 90.0)]) == []


def test_skipped_algorithms_are_footnotes_not_rows():
    rec = conv_record("resnet18_conv2_x", 90.0)
    del rec["results"]["tilegemm:direct"]
    rec["results"]["tilegemm:auto"] = dict(rec["results"]["tilegemm:winograd"], chose="winograd")
    rec["skipped"] = {"direct": "skipped, estimated 32x slower than winograd"}
    (_, headers, rows), = report.conv_tables([rec])
    algorithms = [dict(zip(headers, r))["algorithm"] for r in rows]
    assert algorithms == ["im2col", "winograd", "auto → winograd"]
    assert report.conv_notes([rec]) == [
        "resnet18_conv2_x (float32, 1 thread): direct: skipped, estimated 32x slower than winograd"]
    assert report.conv_notes([conv_record("a", 90.0)]) == []  # older records: no "skipped"


def test_roofline_roofs_at_peak_and_bandwidth_points_at_their_intensity(plots):
    gemm = dict(gemm_record(256, 80.0), flops=2.0 * 256 ** 3)
    conv = dict(conv_record("layer_a", 90.0), flops=1e9, min_bytes=2e7)
    conv["results"]["tilegemm:auto"] = party(70.0)
    points = plots.roofline_points([gemm, conv])
    # GEMM: 2·n³ flops over 3·n² float32 elements once; the layer: flops / min_bytes
    assert points == [("256x256x256", 2.0 * 256 / (3 * 4), 80.0), ("layer_a", 50.0, 70.0)]
    fig = plots.plot_roofline([("float32, 1 thread", 100.0, points)], 20.0, "title")
    (ax,) = fig.axes
    assert fig.get_suptitle() == "title" and ax.get_xscale() == ax.get_yscale() == "log"
    slope, flat = ax.get_lines()
    (x0, x1), (y0, y1) = slope.get_data()
    assert y0 == pytest.approx(20.0 * x0) and (x1, y1) == pytest.approx((5.0, 100.0))
    assert set(flat.get_ydata()) == {100.0}
    placed = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert placed == [(p[1], p[2]) for p in points]


def test_roofline_is_drawn_from_a_report_with_a_bandwidth(plots, tmp_path):
    rep = fake_report(gemm=[dict(gemm_record(64, 20.0), flops=2.0 * 64 ** 3)])
    rep["conv"]["records"] = []
    assert "roofline_float32.png" not in plots.write_plots(rep, str(tmp_path))  # no bandwidth
    rep["memory_bandwidth"] = {"gbps": 15.0}
    assert "roofline_float32.png" in plots.write_plots(rep, str(tmp_path))
    assert (tmp_path / "roofline_float32.png").stat().st_size > 0
