"""The command line end to end on tiny sizes: info, bench, --compare, ladder forwarding.

These tests check what the commands produce (valid JSON and Markdown, the right
rows, graceful degradation without matplotlib or torch, clear errors), never
how fast anything is.
"""
import io
import json
import os
import re
import signal
import subprocess
import sys

import numba
import pytest

import tilegemm
from tilegemm.tools import timing
from tilegemm.tools.cli import build_parser, main
from tilegemm.tools.provenance import source_commit, version_text
from tilegemm.tools.runner import BenchPlan
from tilegemm.tools.compare import compare_rows
from tilegemm.tools.progress import Progress
from tilegemm.tools.peak_cache import peak_key
from tilegemm.tools.report import info_text, machine_info

TINY = ["bench", "--sizes", "16,32", "--dtype", "float32", "--threads", "1",
        "--reps", "2", "--min-time", "0.001"]


def run_cli(argv, capsys):
    """main(argv) in this process -> (status, stdout, stderr); SystemExit becomes a status."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def markdown_tables(text):
    """Every pipe table in ``text`` as a list of rows (lists of cells)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def assert_valid_markdown_tables(text):
    tables = markdown_tables(text)
    assert tables, "no Markdown table found"
    for table in tables:
        assert len(table) >= 3, table
        assert re.fullmatch(r"\|(:?-+:?\|)+", table[1]), f"bad separator line: {table[1]}"
        widths = {line.count("|") for line in table}
        assert len(widths) == 1, f"rows with different cell counts: {table}"
    return tables


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """One tiny bench run shared by several tests: (status, stdout, out_dir)."""
    out = tmp_path_factory.mktemp("tiny")
    buf_out, buf_err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = buf_out, buf_err
    try:
        status = main(TINY + ["--out", str(out)])
    finally:
        sys.stdout, sys.stderr = saved
    return status, buf_out.getvalue(), buf_err.getvalue(), out


# --------------------------------------------------------------------------- info

def test_info_json_has_the_documented_keys(capsys):
    status, out, _ = run_cli(["info", "--json", "--no-peak"], capsys)
    assert status == 0
    info = json.loads(out)
    for key in ("l1d_bytes", "l2_bytes", "l3_bytes", "isa", "cores", "blocking", "peak_gflops"):
        assert key in info, key
    assert info["l1d_bytes"] > 0 and info["l2_bytes"] > info["l1d_bytes"]
    for dtype in ("float32", "float64"):
        blk = info["blocking"][dtype]
        assert {"mr", "nr", "kc", "mc", "nc"} <= set(blk)
        assert set(blk["source"]) == {"mr", "nr", "kc", "mc", "nc"}
        assert info["peak_gflops"][dtype]["nominal"] > 0
        assert info["peak_gflops"][dtype]["measured"] is None  # --no-peak


def test_info_measures_the_peak_and_prints_text(capsys):
    status, out, _ = run_cli(["info"], capsys)
    assert status == 0
    assert "blocking" in out and "peak GFLOPS" in out and "L1d" in out
    info = machine_info()  # the peak is cached in this process now
    assert info["peak_gflops"]["float32"]["measured"] > 0
    assert "1" in info["peak_gflops"]["float32"]["per_threads"]
    assert "commit" in info and "dirty" in info


class FakePeak:
    """A stand-in for the FMA loop: 100 GFLOPS a thread (``scaling`` x 100 for all threads)."""

    def __init__(self, scaling=None):
        self.calls, self.scaling = [], scaling

    def __call__(self, dtype, threads):
        self.calls.append((dtype, threads))
        if threads > 1 and self.scaling is not None:
            return 100.0 * self.scaling
        return 100.0 * threads


def test_info_caches_the_measured_peak_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(tmp_path))
    fake = FakePeak()
    first = machine_info(measure=fake)
    assert len(fake.calls) == 2 * len({1, timing.max_threads()})  # both dtypes, each count
    assert first["peak_gflops"]["float32"]["per_threads"]["1"]["measured"] == 100.0
    assert first["peak_gflops"]["float32"]["per_threads"]["1"]["cached"] is False
    cache = json.loads((tmp_path / "measured-peak.json").read_text())
    key = peak_key(first["brand"], first["isa"], 1, "float32")
    assert cache[key]["gflops"] == 100.0

    again = machine_info(measure=fake)  # reused: nothing measured
    assert len(fake.calls) == 2 * len({1, timing.max_threads()})
    assert again["peak_gflops"]["float64"]["per_threads"]["1"]["cached"] is True
    assert "--remeasure" in info_text(again)

    machine_info(remeasure=True, measure=fake)
    assert len(fake.calls) == 4 * len({1, timing.max_threads()})


@pytest.mark.skipif(timing.max_threads() < 2, reason="needs 2 threads")
def test_info_warns_when_two_threads_do_not_double_the_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(tmp_path))
    busy = FakePeak(scaling=1.5)  # 2 threads: 150 GFLOPS against 100 for one
    info = machine_info(measure=busy)
    assert len(info["warnings"]) == 2 and "not cached" in info["warnings"][0]
    assert "1.50x the 1-thread one" in info["warnings"][0]
    assert "1.50x the 1-thread one" in info_text(info)
    machine_info(measure=busy)  # a busy measurement is not cached: measured again
    assert len(busy.calls) == 8
    quiet = FakePeak(scaling=1.9)
    assert machine_info(measure=quiet)["warnings"] == []


def test_info_remeasure_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(tmp_path))
    status, _, err = run_cli(["info", "--remeasure", "--no-peak"], capsys)
    assert status == 2 and "--remeasure" in err


# --------------------------------------------------------------------------- bench

def test_bench_tiny_writes_json_markdown_and_plots(tiny_report):
    status, out, err, out_dir = tiny_report
    assert status == 0, err
    assert "16x16x16" in out and "32x32x32" in out and "numpy GFLOPS" in out
    report = json.loads((out_dir / "report.json").read_text())
    assert report["format"] == "tilegemm-bench-report/1"
    assert report["machine"]["isa"] and report["machine"]["blocking"]
    source = source_commit()
    assert report["commit"] == (source and source["commit"])
    assert report["dirty"] == (source and source["dirty"]) and report["partial"] is None
    assert report["memory_bandwidth"]["gbps"] > 0 and "GB/s" in out and "Memory bandwidth" in (
        out_dir / "report.md").read_text()
    shapes = [r["shape"] for r in report["gemm"]]
    assert shapes == ["16x16x16", "32x32x32"]
    for rec in report["gemm"]:
        assert rec["check"]["ok"]
        ours = rec["results"]["tilegemm"]
        assert len(ours["samples_s"]) == 2 and ours["gflops"] > 0 and ours["pct_peak"] > 0
        assert rec["results"]["numpy"]["ratio"] > 0
    md = (out_dir / "report.md").read_text()
    tables = assert_valid_markdown_tables(md)
    assert any("16x16x16" in row for t in tables for row in t)
    assert "| min / median / max ms " in md
    if timing.optional_import("matplotlib") is not None:
        assert report["plots"] == ["gemm_float32.png", "roofline_float32.png"]
        assert (out_dir / "gemm_float32.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![gemm_float32](gemm_float32.png)" in md


def test_progress_goes_to_stderr_as_plain_lines_when_not_a_tty(tiny_report):
    _, out, err, _ = tiny_report
    assert "[1/4]" in err and "[4/4]" in err
    assert "\r" not in err and "[1/4]" not in out


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_a_bar_on_a_terminal():
    stream, out = Tty(), io.StringIO()
    p = Progress(2, stream, out)
    p.step("first")
    p.write("first row")
    p.step("second")
    p.close()
    text = stream.getvalue()
    assert "\r[" in text and "2/2" in text and "#" in text and "ETA" in text
    assert out.getvalue() == "first row\n"


@pytest.mark.parametrize("columns", [80, 40])
def test_progress_bar_fits_the_terminal(columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))  # what shutil.get_terminal_size reads first
    stream = Tty()
    p = Progress(3, stream, io.StringIO())
    for i in range(3):
        p.step(f"gemm float32 {'4096x' * 30}4096 (a label far wider than any terminal) {i}")
        p.write("a row")
    p.close()
    lines = re.split(r"[\r\n]", stream.getvalue())
    assert max(len(line) for line in lines) <= columns
    assert sum("ETA" in line for line in lines) == 6  # drawn again after each row


def test_bench_without_matplotlib_skips_plots_and_says_how(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    status, out, _ = run_cli(TINY + ["--sizes", "16", "--out", str(tmp_path)], capsys)
    assert status == 0
    assert "pip install matplotlib" in out
    assert not list(tmp_path.glob("*.png"))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["plots"] == [] and "matplotlib" in report["plots_skipped"]
    assert "Plots skipped" in (tmp_path / "report.md").read_text()


def test_bench_without_torch_drops_the_torch_columns(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    status, out, _ = run_cli(TINY + ["--sizes", "16", "--no-plots", "--out", str(tmp_path)],
                             capsys)
    assert status == 0
    assert "torch" not in out.split("wrote")[0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["gemm"][0]["results"]) == {"tilegemm", "numpy"}
    assert report["machine"]["peers"]["torch"] is None
    md = (tmp_path / "report.md").read_text()
    assert_valid_markdown_tables(md)
    assert "torch GFLOPS" not in md


def test_bench_explicit_shapes(tmp_path, capsys):
    status, out, _ = run_cli(TINY[:1] + ["--shapes", "1x24x40,17x3x5", "--dtype", "f64",
                                         "--threads", "1", "--reps", "1", "--min-time", "0.001",
                                         "--no-plots", "--out", str(tmp_path)], capsys)
    assert status == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["m"], r["n"], r["k"], r["kind"]) for r in report["gemm"]] == [
        (1, 24, 40, "custom"), (17, 3, 5, "custom")]


def test_conv_layers_every_algorithm_or_na(tmp_path, capsys):
    status, out, err = run_cli(["bench", "--op", "conv", "--layers", "resnet18_conv5_x,resnet50_1x1",
                                "--batch", "1", "--dtype", "float32", "--threads", "1",
                                "--reps", "1", "--min-time", "0.001", "--out", str(tmp_path)],
                               capsys)
    assert status == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    by_layer = {r["layer"]: r for r in report["conv"]["records"]}
    three = by_layer["resnet18_conv5_x"]
    # Winograd timed once per tile size; auto held against the fastest of them all
    tiles = {f"tilegemm:winograd F({m}x{m})" for m in (2, 4, 6)}
    assert {"tilegemm:im2col", "tilegemm:auto"} | tiles <= set(three["results"])
    assert "tilegemm:winograd" not in three["results"]
    # direct convolution is estimated far slower on this dense layer: a footnote, not a row
    assert "tilegemm:direct" not in three["results"]
    assert three["skipped"]["direct"].startswith("skipped, estimated ")
    assert all(c["ok"] for c in three["check"].values()) and "tilegemm:auto" in three["check"]
    auto_name = "tilegemm:auto"
    auto = three["results"][auto_name]
    assert "numpy" in three["results"] and auto["ratio_numpy"] > 0
    assert auto["samples_s"] == three["results"][auto["timed_as"]]["samples_s"]
    fastest = max((n for n in three["results"] if n.startswith("tilegemm:") and n != auto_name),
                  key=lambda n: three["results"][n]["gflops"])
    assert auto["best"] == fastest.split(":", 1)[1]
    assert auto["vs_best"] == auto["gflops"] / three["results"][fastest]["gflops"]
    one = by_layer["resnet50_1x1"]
    assert "winograd" in one["not_applicable"] and "tilegemm:winograd" not in one["results"]
    md = (tmp_path / "report.md").read_text()
    assert_valid_markdown_tables(md)
    assert "n/a" in md and "direct: skipped, estimated" in md and "direct: skipped" in out
    assert "of the fastest algorithm timed on" in md and "of the fastest algorithm" in out


def test_conv_nhwc_with_ms_and_memory(tmp_path, capsys):
    status, out, err = run_cli(["bench", "--op", "conv", "--layers", "resnet18_conv5_x",
                                "--batch", "1", "--dtype", "float32", "--threads", "1",
                                "--reps", "1", "--min-time", "0.001", "--layout", "NHWC", "--ms",
                                "--memory", "--no-plots", "--out", str(tmp_path)], capsys)
    assert status == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    (rec,) = report["conv"]["records"]
    assert rec["layout"] == "NHWC" and "tilegemm:im2col" in rec["results"]
    assert all(c["ok"] for c in rec["check"].values())
    assert "NHWC" in out and " ms" in out
    memory = report["conv"]["memory"]
    assert memory["layer"] == "vgg16_conv1_2" and 0 < memory["extra_bytes"]
    assert memory["explicit_bytes"] > 0 and "explicit patch matrix" in out
    assert_valid_markdown_tables((tmp_path / "report.md").read_text())


@pytest.mark.skipif(timing.max_threads() < 2, reason="needs 2 threads")
def test_conv_scaling_times_one_against_many(tmp_path, capsys):
    status, out, err = run_cli(["bench", "--op", "conv", "--layers", "resnet50_1x1",
                                "--batch", "1", "--dtype", "float32", "--threads", "2",
                                "--reps", "1", "--min-time", "0.001", "--scaling",
                                "--no-plots", "--out", str(tmp_path)], capsys)
    assert status == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["conv"]["records"] == []
    (rec,) = report["conv"]["scaling"]
    assert rec["threads"] == 2 and "winograd" in rec["not_applicable"]
    parties = {r["party"] for r in rec["rows"]}
    assert {"tilegemm:im2col", "tilegemm:auto"} <= parties
    assert all(r["one_s"] > 0 and r["many_s"] > 0 for r in rec["rows"])
    assert rec["apart"]["speedup"] > 0
    assert "thread scaling" in out and "apart" in out
    assert_valid_markdown_tables((tmp_path / "report.md").read_text())


# --------------------------------------------------------------------------- compare

def fake_report(cases, brand="Test CPU"):
    """A hand-written report.json: ``cases`` maps a GEMM shape to tilegemm's
    (min, median, max) seconds per call; numpy always takes 1 ms."""
    def party(lo, med, hi):
        return {"best_s": lo, "min_s": lo, "median_s": med, "max_s": hi,
                "gflops": 2e-9 / lo}
    gemm = [{"op": "gemm", "kind": "custom", "shape": shape, "dtype": "float32", "threads": 1,
             "results": {"tilegemm": party(*times), "numpy": party(1e-3, 1e-3, 1e-3)}}
            for shape, times in cases.items()]
    return {"format": "tilegemm-bench-report/1", "created": "2026-01-01T00:00:00+00:00",
            "machine": {"brand": brand, "isa": "avx2", "cores": 2},
            "gemm": gemm, "conv": {"records": []}}


def run_compare(a, b, tmp_path, capsys, extra=()):
    paths = []
    for name, rep in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rep))
    return run_cli(["bench", "--compare", *map(str, paths), *extra], capsys)


def test_compare_exits_1_on_a_regression_beyond_the_noise(tmp_path, capsys):
    a = fake_report({"8x8x8": (1.0e-3, 1.01e-3, 1.02e-3), "9x9x9": (1e-3, 1e-3, 1e-3)})
    b = fake_report({"8x8x8": (1.3e-3, 1.31e-3, 1.33e-3), "9x9x9": (1e-3, 1e-3, 1e-3)})
    status, out, _ = run_compare(a, b, tmp_path, capsys)
    assert status == 1
    (slow,) = [line for line in out.splitlines() if "SLOWER" in line and "8x8x8" in line]
    assert "9x9x9" in out and "1 row(s) SLOWER" in out
    rows, _, _ = compare_rows(a, b)
    assert [r["verdict"] for r in rows] == ["SLOWER", "~"]
    assert rows[0]["noise"] == pytest.approx(0.01 / 1.01 + 0.01 / 1.31)


def test_compare_within_the_repeats_noise_exits_0(tmp_path, capsys):
    a = fake_report({"8x8x8": (1.0e-3, 1.3e-3, 1.6e-3)})   # noisy repeats: band 23% + 4%
    b = fake_report({"8x8x8": (1.2e-3, 1.25e-3, 1.3e-3)})  # 20% slower, inside that band
    status, out, _ = run_compare(a, b, tmp_path, capsys)
    assert status == 0 and "SLOWER" not in out.split("\n\n")[0]
    assert compare_rows(a, b)[0][0]["verdict"] == "~"


def test_compare_threshold_flag_sets_what_counts(tmp_path, capsys):
    a = fake_report({"8x8x8": (1.0e-3, 1.0e-3, 1.0e-3)})
    b = fake_report({"8x8x8": (1.05e-3, 1.05e-3, 1.05e-3)})  # 5% slower, quiet repeats
    assert run_compare(a, b, tmp_path, capsys)[0] == 0                       # default 10%
    assert run_compare(a, b, tmp_path, capsys, ["--threshold", "2"])[0] == 1
    faster = fake_report({"8x8x8": (0.5e-3, 0.5e-3, 0.5e-3)})
    status, out, _ = run_compare(a, faster, tmp_path, capsys)
    assert status == 0 and "faster" in out


def test_compare_reports_missing_rows_without_failing(tmp_path, capsys):
    a = fake_report({"8x8x8": (1e-3, 1e-3, 1e-3), "7x7x7": (1e-3, 1e-3, 1e-3)})
    b = fake_report({"8x8x8": (1e-3, 1e-3, 1e-3), "6x6x6": (1e-3, 1e-3, 1e-3)},
                    brand="Other CPU")
    status, out, _ = run_compare(a, b, tmp_path, capsys)
    assert status == 0
    assert "Only in A (not compared): gemm custom 7x7x7 float32 1t" in out
    assert "Only in B (not compared): gemm custom 6x6x6 float32 1t" in out
    assert "DIFFERENT MACHINES" in out
    del b["gemm"][0]["results"]["tilegemm"]  # a party missing from a shared case
    status, out, _ = run_compare(a, b, tmp_path, capsys)
    assert status == 0 and "8x8x8 float32 1t tilegemm" in out


def test_compare_same_report_is_within_noise(tiny_report, capsys):
    path = str(tiny_report[3] / "report.json")
    status, out, _ = run_cli(["bench", "--compare", path, path], capsys)
    assert status == 0
    table = out.split("\n\n")[0]
    assert "SLOWER" not in table and "faster" not in table
    assert table.count(" ~") == 2  # both shapes within the noise
    report = json.loads(open(path).read())
    ours = report["gemm"][0]["results"]["tilegemm"]
    assert ours["min_s"] <= ours["median_s"] <= ours["max_s"]


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("argv, message", [
    (["bench", "--sizes", "0"], "--sizes"),
    (["bench", "--sizes", "16,abc"], "not an integer"),
    (["bench", "--shapes", "2x3"], "MxNxK"),
    (["bench", "--dtype", "int8"], "unknown dtype"),
    (["bench", "--threads", "9999"], "--threads"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench", "--min-time", "-1"], "--min-time"),
    (["bench", "--layers", "lenet"], "unknown layer"),
    (["bench", "--op", "conv", "--scaling", "--threads", "1"], "--scaling"),
    (["bench", "--layout", "NWHC"], "invalid choice"),
    (["bench", "--op", "fft"], "invalid choice"),
    (["bench", "--frobnicate"], "unrecognized arguments"),
    (["bench", "--compare", "/nonexistent/a.json", "/nonexistent/b.json"], "cannot read"),
    (["bench", "--sizes", "64", "--op", "conv"], "cannot go with --op conv"),
    (["bench", "--shapes", "2x2x2", "--op", "conv"], "--shapes names GEMM"),
    (["bench", "--layers", "resnet50_1x1", "--op", "gemm"], "--layers is a convolution"),
    (["bench", "--batch", "2", "--op", "gemm"], "--batch is a convolution"),
    (["bench", "--layout", "NHWC", "--op", "gemm"], "--layout is a convolution"),
    (["bench", "--ms", "--op", "gemm"], "--ms is a convolution"),
    (["bench", "--scaling", "--op", "gemm"], "--scaling is a convolution"),
    (["bench", "--memory", "--op", "gemm"], "--memory is a convolution"),
    (["bench", "--compare", "a.json", "b.json", "--sizes", "64"], "--sizes cannot go with"),
    (["bench", "--compare", "a.json", "b.json", "--quick", "--out", "x"], "--quick, --out"),
    (["bench", "--sizes", "16", "--threshold", "5"], "--threshold only applies"),
    (["launch"], "invalid choice"),
    ([], "required"),
])
def test_bad_options_exit_2_with_a_clear_message(argv, message, capsys):
    status, _, err = run_cli(argv, capsys)
    assert status == 2
    assert message in err


def _plan(argv, tmp_path):
    args = build_parser().parse_args(["bench", "--out", str(tmp_path)] + argv)
    return BenchPlan.from_args(args, command="test")


@pytest.mark.parametrize("argv, ops", [
    ([], ("gemm", "conv", "int8")),
    (["--sizes", "16"], ("gemm",)),
    (["--layers", "resnet50_1x1"], ("conv",)),
    (["--batch", "2"], ("conv",)),
    (["--layout", "NHWC"], ("conv",)),
    (["--ms"], ("conv",)),
    (["--memory"], ("conv",)),
    (["--sizes", "16", "--layers", "resnet50_1x1"], ("gemm", "conv", "int8")),
    (["--op", "all", "--ms"], ("gemm", "conv", "int8")),
    (["--op", "int8"], ("int8",)),
])
def test_options_imply_the_op_they_belong_to(argv, ops, tmp_path):
    assert _plan(argv, tmp_path).ops == ops


def test_int8_takes_no_gemm_or_conv_options(capsys):
    status, _, err = run_cli(["bench", "--op", "int8", "--sizes", "64"], capsys)
    assert status == 2 and "--sizes cannot go with --op int8" in err


def test_out_naming_a_file_is_rejected_before_measuring(tmp_path, capsys):
    target = tmp_path / "report.md"
    target.write_text("keep me")
    status, out, err = run_cli(TINY + ["--out", str(target)], capsys)
    assert status == 2 and "is a file" in err and "Traceback" not in err
    assert out == "" and "[1/" not in err  # nothing was measured
    assert target.read_text() == "keep me"


def test_out_in_an_unwritable_place_is_rejected_before_measuring(tmp_path, capsys):
    (tmp_path / "plain").write_text("")
    status, out, err = run_cli(TINY + ["--out", str(tmp_path / "plain" / "sub")], capsys)
    assert status == 2 and "cannot write to" in err
    assert out == "" and "[1/" not in err


def test_version_prints_the_version_and_the_commit():
    proc = subprocess.run([sys.executable, "-m", "tilegemm", "--version"], cwd="/",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    source = source_commit()
    assert proc.stdout.startswith(f"tilegemm {tilegemm.__version__} (commit ")
    if source is not None:  # running from a git checkout
        assert source["commit"] in proc.stdout
        assert proc.stdout.strip().endswith("+dirty)") == source["dirty"]


def test_version_outside_a_git_checkout_says_unknown(tmp_path):
    assert source_commit(str(tmp_path)) is None
    assert version_text(str(tmp_path)).endswith("(commit unknown)")


def test_compare_rejects_a_file_that_is_not_a_report(tmp_path, capsys):
    bogus = tmp_path / "x.json"
    bogus.write_text('{"hello": 1}')
    status, _, err = run_cli(["bench", "--compare", str(bogus), str(bogus)], capsys)
    assert status == 2 and "not a tilegemm bench report" in err


def test_module_entry_point_rejects_bad_options():
    proc = subprocess.run([sys.executable, "-m", "tilegemm", "bench", "--sizes", "-4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--sizes" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- ladder

def test_ladder_is_forwarded(monkeypatch):
    seen = []
    fake = type(sys)("tilegemm.ladder")
    fake.main = lambda argv=None: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "tilegemm.ladder", fake)
    monkeypatch.setattr(tilegemm, "ladder", fake, raising=False)
    assert main(["ladder", "--n", "64"]) == 7
    assert seen == [["--n", "64"]]


def test_ladder_missing_module_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tilegemm.ladder", None)
    monkeypatch.delattr(tilegemm, "ladder", raising=False)
    assert main(["ladder"]) == 2
    assert "not available" in capsys.readouterr().err


def test_console_script_points_at_main():
    pyproject = os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml")
    with open(pyproject) as f:
        assert 'tilegemm = "tilegemm.__main__:main"' in f.read()


# --------------------------------------------------------------------------- progress, Ctrl-C

def test_rows_print_as_they_finish_and_ctrl_c_writes_a_partial_report(tmp_path):
    """A real run, interrupted by SIGINT once its first GEMM row has been printed."""
    argv = [sys.executable, "-m", "tilegemm", "bench", "--sizes", ",".join(["24"] * 60),
            "--dtype", "float32", "--threads", "1", "--reps", "3", "--min-time", "0.05",
            "--no-torch", "--out", str(tmp_path)]
    # A shell starts background jobs with SIGINT ignored, and a child inherits that:
    # give the run the default disposition, as a terminal's Ctrl-C would find it.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in proc.stdout:  # rows arrive while the run goes on
            lines.append(line)
            if line.startswith("gemm 24x24x24"):
                proc.send_signal(signal.SIGINT)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert any(line.startswith("machine:") for line in lines)
    assert "Traceback" not in err and "interrupted" in err
    report = json.loads((tmp_path / "report.json").read_text())
    partial = report["partial"]
    assert partial["steps_total"] == 62 and 3 <= partial["steps_done"] < 62
    # the machine and memory-bandwidth steps, then rows
    assert len(report["gemm"]) == partial["steps_done"] - 2
    assert report["gemm"][0]["results"]["tilegemm"]["gflops"] > 0
    assert "Partial report" in (tmp_path / "report.md").read_text()


def test_pinned_threads_puts_every_limit_back():
    """threadpoolctl restores every library it found on leaving, tilegemm's included:
    the pin must not leave tilegemm at the pinned count."""
    from tilegemm.ground import threads
    from tilegemm.tools import timing
    before = (threads.process_limit(), numba.get_num_threads())
    with timing.pinned_threads(1):
        assert threads.get_num_threads() == 1
    assert (threads.process_limit(), numba.get_num_threads()) == before
