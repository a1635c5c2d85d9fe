"""The command line end to end on tiny sizes: info, bench, --compare, ladder forwarding.

These tests check what the commands produce (valid JSON and Markdown, the right
rows, graceful degradation without matplotlib or torch, clear errors), never
how fast anything is.
"""
import copy
import io
import json
import os
import re
import subprocess
import sys

import pytest

import tilegemm
from tilegemm.tools import timing
from tilegemm.tools.cli import main
from tilegemm.tools.compare import compare_rows
from tilegemm.tools.progress import Progress
from tilegemm.tools.report import machine_info

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


# --------------------------------------------------------------------------- bench

def test_bench_tiny_writes_json_markdown_and_plots(tiny_report):
    status, out, err, out_dir = tiny_report
    assert status == 0, err
    assert "16x16x16" in out and "32x32x32" in out and "numpy GFLOPS" in out
    report = json.loads((out_dir / "report.json").read_text())
    assert report["format"] == "tilegemm-bench-report/1"
    assert report["machine"]["isa"] and report["machine"]["blocking"]
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
    if timing.optional_import("matplotlib") is not None:
        assert report["plots"] == ["gemm_float32.png"]
        assert (out_dir / "gemm_float32.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![gemm_float32](gemm_float32.png)" in md


def test_progress_goes_to_stderr_as_plain_lines_when_not_a_tty(tiny_report):
    _, out, err, _ = tiny_report
    assert "[1/3]" in err and "[3/3]" in err
    assert "\r" not in err and "[1/3]" not in out


def test_progress_draws_a_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    stream = Tty()
    p = Progress(2, stream)
    p.step("first")
    p.step("second")
    p.close()
    text = stream.getvalue()
    assert "\r[" in text and "2/2" in text and "#" in text


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
    assert {"tilegemm:im2col", "tilegemm:winograd", "tilegemm:direct", "tilegemm:auto"} <= set(
        three["results"])
    assert all(c["ok"] for c in three["check"].values())
    one = by_layer["resnet50_1x1"]
    assert "winograd" in one["not_applicable"] and "tilegemm:winograd" not in one["results"]
    md = (tmp_path / "report.md").read_text()
    assert_valid_markdown_tables(md)
    assert "n/a" in md


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

def test_compare_flags_changes_beyond_the_noise(tiny_report, tmp_path, capsys):
    out_dir = tiny_report[3]
    a = json.loads((out_dir / "report.json").read_text())
    b = copy.deepcopy(a)
    for rec in (a["gemm"][0], b["gemm"][0]):
        for party in rec["results"].values():
            party["spread"] = 0.01
    b["gemm"][0]["results"]["tilegemm"]["gflops"] *= 2  # twice as fast, same numpy
    rows, only_a, only_b = compare_rows(a, b)
    assert (only_a, only_b) == (0, 0)
    first = rows[0]
    assert first["change"] == pytest.approx(2.0) and first["verdict"] == "faster"
    assert first["ratio_verdict"] == "faster"
    path_b = tmp_path / "b" / "report.json"
    path_b.parent.mkdir()
    path_b.write_text(json.dumps(b))
    status, out, _ = run_cli(["bench", "--compare", str(out_dir / "report.json"), str(path_b)],
                             capsys)
    assert status == 0
    assert "faster" in out and "noise" in out


def test_compare_same_report_is_within_noise(tiny_report, capsys):
    path = str(tiny_report[3] / "report.json")
    status, out, _ = run_cli(["bench", "--compare", path, path], capsys)
    assert status == 0
    table = out.split("\n\n")[0]
    assert "SLOWER" not in table and "faster" not in table
    assert table.count(" ~") == 4  # both shapes, GFLOPS and ratio, within the noise


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
    (["launch"], "invalid choice"),
    ([], "required"),
])
def test_bad_options_exit_2_with_a_clear_message(argv, message, capsys):
    status, _, err = run_cli(argv, capsys)
    assert status == 2
    assert message in err


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
