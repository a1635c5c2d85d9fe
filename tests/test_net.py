"""Networks loaded from ONNX: results against a float64 reference interpreter, the
graph passes (folding, fusion), dynamic shapes, threads, and clear errors for
models and inputs that cannot run."""
import sys
import threading

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

import tilegemm  # noqa: E402
from guard import GUARD_PAGES, guarded_empty  # noqa: E402
from net_models import MODELS, Builder, assert_close, random_input  # noqa: E402
from net_reference import run_reference  # noqa: E402


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_match_the_float64_reference(name):
    build, shape = MODELS[name]
    model = build()
    net = tilegemm.load_onnx(model)
    x = random_input(shape)
    before = x.copy()
    got = net.run({"x": x})
    expected = run_reference(model, {"x": x})
    assert list(got) == [o.name for o in model.graph.output]
    for key in expected:
        assert got[key].dtype == np.float32
        assert_close(got[key], expected[key])
    np.testing.assert_array_equal(x, before)          # the input is never changed


@pytest.mark.parametrize("batch", [1, 3])
def test_symbolic_batch_runs_any_batch(batch):
    model = MODELS["resnet"][0]()
    net = tilegemm.load_onnx(model)
    x = random_input((batch, 3, 32, 32), seed=batch)
    assert_close(net(x), run_reference(model, {"x": x})[model.graph.output[0].name])


def test_path_bytes_and_model_load_alike(tmp_path):
    model = MODELS["vgg"][0]()
    path = tmp_path / "vgg.onnx"
    onnx.save(model, str(path))
    x = random_input((2, 3, 16, 16))
    results = [tilegemm.load_onnx(m)(x) for m in (model, str(path), path,
                                                   model.SerializeToString())]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_passes_fold_batchnorm_and_fuse_epilogues():
    net = tilegemm.load_onnx(MODELS["resnet"][0]())
    ops = [n.op for n in net.graph.nodes]
    assert "BatchNormalization" not in ops and "Relu" not in ops and "Add" not in ops
    convs = [n for n in net.graph.nodes if n.op == "Conv"]
    assert len(convs) == 6
    residual = [n for n in convs if n.epilogue.get("residual")]
    assert len(residual) == 2
    assert all(n.epilogue.get("activation") == "relu" for n in residual)
    assert all(n.fused == ["BatchNormalization", "Add", "Relu"] for n in residual)


def test_relu6_and_conv_plus_conv_sum_are_fused():
    mobile = tilegemm.load_onnx(MODELS["mobilenet"][0]())
    acts = [n.epilogue.get("activation") for n in mobile.graph.nodes if n.op == "Conv"]
    assert acts.count("relu6") == 3 and "Clip" not in [n.op for n in mobile.graph.nodes]
    vgg = tilegemm.load_onnx(MODELS["vgg"][0]())
    fused = [n for n in vgg.graph.nodes if n.op == "Conv" and n.epilogue.get("residual")]
    assert [n.fused for n in fused] == [["Add", "Relu"], ["Add"]]
    gemm = [n for n in vgg.graph.nodes if n.op == "Gemm"]
    assert gemm[0].epilogue == {"activation": "relu"} and gemm[1].epilogue == {}


def test_constant_subgraphs_fold_at_load():
    b = Builder()
    shape = b.op("Concat", [b.const(np.array([2], np.int64)), b.const(np.array([-1], np.int64))],
                 axis=0)
    y = b.op("Reshape", ["x", b.op("Identity", [shape])])
    net = tilegemm.load_onnx(b.model([2, 3, 4, 4], [(y, 2)]))
    assert [n.op for n in net.graph.nodes] == ["Reshape"]
    x = random_input((2, 3, 4, 4))
    np.testing.assert_array_equal(net(x), x.reshape(2, -1))


def test_calls_from_several_python_threads_agree():
    build, shape = MODELS["resnet"]
    net = tilegemm.load_onnx(build())
    xs = [random_input(shape, seed=s) for s in range(4)]
    expected = [net(x) for x in xs]
    results, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(3):
                results[i] = net(xs[i])
        except Exception as err:  # reported below
            errors.append(err)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want in zip(results, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- errors
def _one_node(op, inputs=("x",), **attrs):
    b = Builder()
    y = b.op(op, list(inputs), **attrs)
    return b.model([1, 2, 6, 6], [(y, 4)])


def test_unknown_operator_names_the_node():
    with pytest.raises(NotImplementedError, match=r"node 'Foo_0': operator Foo is not supported"):
        tilegemm.load_onnx(_one_node("Foo"))


@pytest.mark.parametrize("op, attrs, match", [
    ("MaxPool", dict(kernel_shape=[2, 2], storage_order=1), "storage_order"),
    ("MaxPool", dict(kernel_shape=[2, 2, 2]), "only 2-D"),
    ("Pad", dict(mode="wrap"), "mode 'wrap'"),
])
def test_unsupported_attributes_are_named(op, attrs, match):
    inputs = ("x",) if op != "Pad" else ("x", "pads")
    model = _one_node(op, inputs, **attrs)
    if op == "Pad":
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(8, np.int64), "pads"))
    with pytest.raises(NotImplementedError, match=match):
        tilegemm.load_onnx(model)


def test_attributes_outside_an_operators_list_are_named():
    node = tilegemm.net.Node("Relu", "r", ["x"], ["y"], {"alpha": 1.0})
    with pytest.raises(NotImplementedError, match=r"node 'r' \(Relu\): attributes \['alpha'\]"):
        tilegemm.net.registry.check(node)


def test_conv_with_runtime_weights_is_refused_at_load():
    b = Builder()
    y = b.op("Conv", ["x", "x"])
    with pytest.raises(NotImplementedError, match="constant 4-D"):
        tilegemm.load_onnx(b.model([1, 2, 6, 6], [(y, 4)]))


def test_bad_inputs_get_clear_errors():
    net = tilegemm.load_onnx(MODELS["resnet"][0]())
    with pytest.raises(ValueError, match=r"must have shape \('\?', 3, 32, 32\)"):
        net(np.zeros((1, 4, 32, 32), np.float32))
    with pytest.raises(ValueError, match="must have shape"):
        net(np.zeros((3, 32, 32), np.float32))
    with pytest.raises(TypeError, match="float array"):
        net(np.zeros((1, 3, 32, 32), np.int32))
    with pytest.raises(ValueError, match="missing"):
        net.run({})
    with pytest.raises(ValueError, match="not inputs"):
        net.run({"x": np.zeros((1, 3, 32, 32), np.float32), "y": 1})
    with pytest.raises(TypeError, match="dict"):
        net.run([np.zeros((1, 3, 32, 32))])
    # float64 is cast to the model's float32
    assert net(np.zeros((1, 3, 32, 32))).dtype == np.float32


def test_broken_models_and_files(tmp_path):
    data = MODELS["resnet"][0]().SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[:len(data) // 3])
    with pytest.raises(ValueError, match="ONNX"):
        tilegemm.load_onnx(str(path))
    with pytest.raises(FileNotFoundError):
        tilegemm.load_onnx(str(tmp_path / "missing.onnx"))
    with pytest.raises(TypeError, match="path, bytes or an onnx.ModelProto"):
        tilegemm.load_onnx(42)
    bad = _one_node("Relu", ("nowhere",))
    with pytest.raises(ValueError):
        tilegemm.load_onnx(bad)
    short = MODELS["resnet"][0]()                   # a weight's data cut short
    weight = short.graph.initializer[0]
    weight.raw_data = weight.raw_data[:-4]
    with pytest.raises(ValueError, match=f"initializer '{weight.name}' is malformed"):
        tilegemm.load_onnx(short)


def test_shape_mismatch_inside_the_graph_names_the_node():
    b = Builder()
    y = b.op("Reshape", ["x", b.const(np.array([5, -1], np.int64))])
    net = tilegemm.load_onnx(b.model([1, 2, 6, 6], [(y, 4)]))
    with pytest.raises(ValueError, match="Reshape"):
        net(np.zeros((1, 2, 6, 6), np.float32))


def test_without_onnx_the_error_says_what_to_install(monkeypatch):
    model = MODELS["vgg"][0]().SerializeToString()
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match=r"pip install 'tilegemm\[onnx\]'"):
        tilegemm.load_onnx(model)


def test_old_opsets_are_converted():
    b = Builder()
    y = b.op("Relu", [b.op("Unsqueeze", ["x"], axes=[0])])
    model = b.model([2, 3], [(y, 3)], opset=11)
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], np.float32)
    np.testing.assert_array_equal(tilegemm.load_onnx(model)(x), np.maximum(x, 0)[None])
    assert helper.make_opsetid("", 11).version == 11


@pytest.mark.skipif(not GUARD_PAGES, reason="no mmap guard pages here")
@pytest.mark.parametrize("where", ["after", "before"])
def test_an_input_against_a_guard_page_is_read_within_bounds(where):
    """Every step of a network (NCHW, and NHWC where the plan takes it) reads its
    input only inside it: one element past either end faults."""
    build, shape = MODELS["mobilenet"]
    model = build()
    x = guarded_empty(shape, np.float32, where=where)
    x[...] = random_input(shape)
    for transform in (False, True):
        got = tilegemm.load_onnx(model, layout_transform=transform)(x)
        assert_close(got, run_reference(model, {"x": np.array(x)})[model.graph.output[0].name])


def test_a_run_that_fails_leaves_no_partial_replay():
    """The run that records what later runs replay fails half-way: nothing of it is
    kept, the next run records afresh and the one after replays a whole run."""
    build, shape = MODELS["resnet"]
    net = tilegemm.load_onnx(build(), layout_transform=False)
    x = random_input(shape)
    want = net(x)                                  # records the shapes
    step = net.steps[len(net.steps) // 2]
    kept = step.run

    def fails(*args, **kwargs):
        raise RuntimeError("a step failed")
    step.run = fails
    with pytest.raises(RuntimeError, match="a step failed"):
        net(x)
    step.run = kept
    for _ in range(2):                             # records, then replays
        np.testing.assert_array_equal(net(x), want)
