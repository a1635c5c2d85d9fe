"""``python -m tilegemm run``: a model file or a built-in name, the profile and the
plan dump, the peers when installed, and clear exits for bad input."""
import json
import re

import pytest

pytest.importorskip("onnx")

from net_models import MODELS  # noqa: E402
from tilegemm.tools.cli import main  # noqa: E402


@pytest.fixture(autouse=True)
def _own_costs(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEMM_NET_COSTS", str(tmp_path / "net-costs.json"))


@pytest.fixture(autouse=True)
def _threads_restored():
    """``run --threads T`` sets the process's thread count, as a command should; the
    tests after these must find it as it was."""
    import tilegemm
    threads = tilegemm.get_num_threads()
    yield
    tilegemm.set_num_threads(threads)


def _saved(tmp_path, name="resnet"):
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(MODELS[name][0]().SerializeToString())
    return str(path)


def test_run_prints_latency_plan_profile_and_dumps_the_plan(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    status = main(["run", _saved(tmp_path), "--batch", "2", "--repeats", "2", "--profile",
                   "--dump", str(plan), "--both-plans", "--threads", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "input (2, 3, 32, 32) float32, 1 thread(s)" in out
    assert re.search(r"tilegemm +best +[\d.]+ ms", out)
    assert re.search(r"tilegemm NCHW +best", out) and re.search(r"tilegemm NHWC +best", out)
    assert "layout plan: steps per layout" in out
    rows = json.loads(plan.read_text())
    assert {r["op"] for r in rows} >= {"Conv", "MaxPool", "Gemm"}
    convs = [r for r in rows if r["op"] == "Conv"]
    assert all(r["layout"] in ("NCHW", "NHWC") and r["algorithm"] and r["flops"] > 0
               for r in convs)
    assert any(r["fused"] == ["BatchNormalization", "Add", "Relu"] for r in convs)
    assert "Conv_0" in out and "GFLOPS" in out


def test_run_compares_with_onnxruntime_when_installed(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    status = main(["run", _saved(tmp_path, "vgg"), "--input-shape", "1,3,16,16",
                   "--repeats", "2", "--no-layout-transform"])
    out = capsys.readouterr().out
    assert status == 0, out
    diff = float(re.search(r"max \|tilegemm - onnxruntime\| / max \|onnxruntime\| = ([^;\s]+)",
                           out).group(1))
    assert diff <= 1e-4
    assert re.search(r"onnxruntime +best .* tilegemm's time", out)


@pytest.mark.parametrize("argv, message", [
    (["run", "/nonexistent/model.onnx"], "no such model file"),
    (["run", "resnet18", "--batch", "0"], "must be positive"),
])
def test_run_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_run_asks_for_the_shape_of_symbolic_dimensions(tmp_path, capsys):
    from tilegemm.tools.zoo import Builder
    b = Builder()
    y = b.op("Relu", ["x"])
    path = tmp_path / "relu.onnx"
    path.write_bytes(b.model(["N", 3, "H", "W"], [(y, 4)]).SerializeToString())
    assert main(["run", str(path), "--no-compare"]) == 2
    assert "give --input-shape" in capsys.readouterr().err
    assert main(["run", str(path), "--no-compare", "--input-shape", "1,3,5,5",
                 "--repeats", "1"]) == 0
    assert "input (1, 3, 5, 5) float32" in capsys.readouterr().out


def test_run_scaling_times_one_thread_beside_all(tmp_path, capsys):
    from tilegemm.ground.threads import max_threads
    if max_threads() < 2:
        pytest.skip("one core")
    status = main(["run", _saved(tmp_path), "--repeats", "2", "--threads", "2", "--scaling",
                   "--no-compare"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert re.search(r"tilegemm 1 thread +best", out)
    assert re.search(r"2 threads give [\d.]+x the one-thread throughput", out)


def test_run_int8_quantizes_the_model_and_runs_it_on_the_int8_kernels(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    plan = tmp_path / "plan.json"
    status = main(["run", _saved(tmp_path), "--int8", "--repeats", "2", "--threads", "1",
                   "--dump", str(plan)])
    out = capsys.readouterr().out
    assert status == 0, out
    diff = float(re.search(r"max \|tilegemm - onnxruntime\| / max \|onnxruntime\| = ([^;\s]+)",
                           out).group(1))
    assert diff <= 0.1
    rows = json.loads(plan.read_text())
    ops = {r["op"] for r in rows}
    assert "QLinearConv" in ops and "Conv" not in ops and "Add" not in ops
    # the residual sums run on the codes: as QLinearAdd steps, or in a conv's epilogue
    assert "QLinearAdd" in ops or any("Add" in r["fused"] for r in rows
                                      if r["op"] == "QLinearConv")
