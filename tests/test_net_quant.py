"""Quantized ONNX models: QDQ convolutions and residual sums fused onto the int8
kernels, QOperator nodes, against the reference interpreter's definitions."""
import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

pytest.importorskip("onnx")

import tilegemm  # noqa: E402
from fuzz_settings import fuzz_settings  # noqa: E402
from guard import GUARD_PAGES, guarded_empty  # noqa: E402
from net_reference import run_reference  # noqa: E402
from qdq_models import QBuilder, residual_block  # noqa: E402
from thread_runs import in_threads  # noqa: E402
from tilegemm.net.layers import pool2d  # noqa: E402
from tilegemm.net.quantized import (add_run, dequantize_linear, plane_means,  # noqa: E402
                                    quantize_linear)


def _codes_close(got, want):
    """Codes equal but where the float rounding of the reference (float32 division, as
    ONNX's QuantizeLinear of a float32 conv output) and of the fused epilogue (float64)
    fall on either side of a tie: a neighbouring code, for a few in 10^5 values."""
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    assert diff.max(initial=0) <= 1, diff.max(initial=0)
    assert np.count_nonzero(diff) <= max(2, diff.size // 1000), np.count_nonzero(diff)


def _ops(net):
    return [s.node.op for s in net.steps]


def _layouts(net, x, layout):
    """The network's output with every step that can run in ``layout``."""
    plan = net.plan({"x": x}, layouts={s.node.name: layout for s in net.steps if s.node.op in
                                       ("QLinearConv", "QLinearAdd", "ConvInteger", "MaxPool")})
    assert plan.layouts.count(layout) >= 1
    return net(x)


def _summed(net):
    """The QLinearConv steps with a residual sum fused in."""
    return [s.node for s in net.steps if s.node.op == "QLinearConv" and "sum" in s.node.epilogue]


def _unfused(model, monkeypatch):
    """``model`` loaded without :func:`~tilegemm.net.passes.fuse_qconv_sum` (its sums
    as QLinearAdd steps)."""
    from tilegemm.net import passes
    with monkeypatch.context() as m:
        m.setattr(passes, "PASSES", tuple(p for p in passes.PASSES
                                          if p is not passes.fuse_qconv_sum))
        return tilegemm.load_onnx(model, layout_transform=False)


def test_a_qdq_residual_block_runs_on_the_int8_kernels(monkeypatch):
    model = residual_block()
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert _ops(net).count("QLinearConv") == 2 and "QLinearAdd" not in _ops(net)
    assert len(_summed(net)) == 1              # the second conv sums the shortcut
    assert "Conv" not in _ops(net) and "Add" not in _ops(net)
    plain = _unfused(model, monkeypatch)
    assert "QLinearAdd" in _ops(plain) and not _summed(plain)
    x = np.random.default_rng(1).standard_normal((1, 8, 9, 9)).astype(np.float32)
    want = run_reference(model, {"x": x})[model.graph.output[0].name]
    got = net(x)
    assert got.dtype == np.float32
    # Dequantized codes: one output step (0.07) apart at most, where a tie fell the
    # other way in a layer before.
    assert np.max(np.abs(got - want)) <= 0.07 * 2 + 1e-6
    assert np.mean(np.abs(got - want) > 1e-5) <= 0.05
    for layout in ("NCHW", "NHWC"):
        np.testing.assert_array_equal(_layouts(net, x, layout), got)
        np.testing.assert_array_equal(_layouts(plain, x, layout), got)


def _sum_block(seed, conv_first, relu, signed, shortcut):
    """x -> conv -> Q/DQ, summed with a shortcut (the input's codes, a 1x1 conv's, or a
    constant that broadcasts), the operands in either order, [Relu], Q/DQ."""
    b = QBuilder(seed)
    zero = np.int8(-6) if signed else np.uint8(128)
    x = b.qdq("x", 0.05, zero)
    y = b.qdq(b.conv(x, 8, 8, 3, pads=[1, 1, 1, 1]), 0.06, np.uint8(120))
    if shortcut == "conv":
        r = b.qdq(b.conv(x, 8, 8, 1), 0.05, np.int8(3))
    elif shortcut == "constant":
        r = b.dq(b.const(np.arange(8, dtype=np.uint8).reshape(8, 1, 1) * 30), np.float32(0.03),
                 np.uint8(10))
    else:
        r = x
    s = b.node("Add", [y, r] if conv_first else [r, y])
    out = b.qdq(b.node("Relu", [s]) if relu else s, 0.07, np.int8(-2) if signed else np.uint8(0))
    return b.model([2, 8, 7, 9], out)


@pytest.mark.parametrize("shortcut", ["input", "conv", "constant"])
@pytest.mark.parametrize("conv_first, relu, signed", [(True, True, False), (False, False, True),
                                                      (False, True, False)])
def test_a_sum_fused_into_its_conv_is_the_qlinearadd(shortcut, conv_first, relu, signed,
                                                     monkeypatch):
    """A QLinearAdd of a conv's codes becomes that conv's epilogue: bit for bit the
    unfused network's, in both layouts; of two convs the later one takes it; a
    constant shortcut broadcasts (the three steps after the conv)."""
    model = _sum_block(3, conv_first, relu, signed, shortcut)
    net, plain = tilegemm.load_onnx(model, layout_transform=False), _unfused(model, monkeypatch)
    assert "QLinearAdd" not in _ops(net) and "QLinearAdd" in _ops(plain)
    summed = _summed(net)
    assert len(summed) == 1 and summed[0].epilogue["sum"] == {
        "activation": "relu" if relu else None,
        "conv_first": conv_first != (shortcut == "conv")}   # the later conv: the 1x1
    x = np.random.default_rng(3).standard_normal((2, 8, 7, 9)).astype(np.float32)
    want = plain(x)
    ref = run_reference(model, {"x": x})[model.graph.output[0].name]
    # dequantized codes: one output step (0.07) apart at most, where a tie fell the
    # other way in a layer before
    assert np.max(np.abs(want - ref)) <= 0.07 * 2 + 1e-6
    assert np.mean(np.abs(want - ref) > 1e-5) <= 0.05
    for layout in ("NCHW", "NHWC"):
        np.testing.assert_array_equal(_layouts(net, x, layout), want)
        if shortcut != "constant":        # a QLinearAdd that broadcasts runs NCHW only
            np.testing.assert_array_equal(_layouts(plain, x, layout), want)


@pytest.mark.parametrize("residual_dtype", [np.int8, np.uint8])
def test_a_fused_sum_whose_residual_has_no_zero_point(residual_dtype, monkeypatch):
    """A residual dequantized without a zero point (ONNX: 0 of the codes' own dtype):
    the fused conv takes the residual's dtype from the tensor, as the QLinearAdd did."""
    b = QBuilder(5)
    x = b.qdq("x", 0.05, np.uint8(128))
    y = b.qdq(b.conv(x, 8, 8, 3, pads=[1, 1, 1, 1]), 0.06, np.uint8(120))
    codes = b.q(b.conv(x, 8, 8, 1), 0.05, residual_dtype(0))
    r = b.node("DequantizeLinear", [codes, b.const(np.float32(0.05))])
    out = b.qdq(b.node("Add", [r, y]), 0.07, np.uint8(0))
    model = b.model([1, 8, 7, 9], out)
    net, plain = tilegemm.load_onnx(model, layout_transform=False), _unfused(model, monkeypatch)
    assert len(_summed(net)) == 1
    x = np.random.default_rng(5).standard_normal((1, 8, 7, 9)).astype(np.float32)
    want = plain(x)
    for layout in ("NCHW", "NHWC"):
        np.testing.assert_array_equal(_layouts(net, x, layout), want)


def test_a_conv_output_read_twice_keeps_its_qlinearadd():
    """A conv's codes that another step also reads are not summed in its epilogue."""
    b = QBuilder(4)
    x = b.qdq("x", 0.05, np.uint8(128))
    y = b.q(b.conv(x, 4, 4, 3, pads=[1, 1, 1, 1]), 0.06, np.uint8(120))
    s = b.node("Add", [b.dq(y, np.float32(0.06), np.uint8(120)), x])
    out = b.node("Concat", [b.q(s, 0.07, np.uint8(0)), y], axis=1)
    model = b.model([1, 4, 5, 5], out, out_dtype=np.uint8)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert "QLinearAdd" in _ops(net) and not _summed(net)
    x = np.random.default_rng(4).standard_normal((1, 4, 5, 5)).astype(np.float32)
    _codes_close(net(x), run_reference(model, {"x": x})[out])


@st.composite
def _qdq_layers(draw):
    groups = draw(st.sampled_from([1, 1, 2, 4]))
    C = groups * draw(st.integers(1, 4))
    K = groups * draw(st.integers(1, 4))
    k = draw(st.sampled_from([1, 3, 5]))
    s, d = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    pads = [draw(st.integers(0, 2)) for _ in range(4)]
    H, W = draw(st.integers(1, 11)), draw(st.integers(1, 11))
    assume(min(H + pads[0] + pads[2], W + pads[1] + pads[3]) >= d * (k - 1) + 1)
    return dict(groups=groups, C=C, K=K, k=k, strides=[s, s], dilations=[d, d], pads=pads,
                H=H, W=W, bias=draw(st.sampled_from(["float", "int32", None])),
                per_channel=draw(st.booleans()), act=draw(st.sampled_from([None, "Relu"])),
                requant=draw(st.booleans()), signed=draw(st.booleans()), n=draw(st.integers(1, 2)),
                pool=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


@fuzz_settings(scale=0.5)
@given(_qdq_layers())
def test_fuzz_qdq_conv_against_the_reference(case):
    """One QDQ conv of random geometry, weights per channel or not, three bias forms,
    int8 or uint8 codes, with or without a QuantizeLinear after it (float output),
    after a max pooling of the codes (2x2, stride 1, padded, same size) or not, in
    both layouts."""
    b = QBuilder(case["seed"])
    zero = np.int8(-5) if case["signed"] else np.uint8(131)
    x = b.qdq("x", 0.04, zero)
    if case["pool"]:
        x = b.qdq(b.node("MaxPool", [x], kernel_shape=[2, 2], pads=[1, 1, 0, 0]), 0.04, zero)
    y = b.conv(x, case["C"], case["K"], case["k"], groups=case["groups"], bias=case["bias"],
               per_channel=case["per_channel"], strides=case["strides"],
               dilations=case["dilations"], pads=case["pads"])
    if case["act"]:
        y = b.node(case["act"], [y])
    out = b.q(y, 0.05, np.uint8(7)) if case["requant"] else y
    model = b.model([case["n"], case["C"], case["H"], case["W"]], out,
                    out_dtype=np.uint8 if case["requant"] else np.float32)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert "QLinearConv" in _ops(net) and "Conv" not in _ops(net)
    assert _ops(net).count("QuantizeLinear") == 1          # the input's: pooled codes
    x = np.random.default_rng(case["seed"]).standard_normal(
        (case["n"], case["C"], case["H"], case["W"])).astype(np.float32)
    want = run_reference(model, {"x": x})[out]
    for layout in ("NCHW", "NHWC"):
        got = _layouts(net, x, layout)
        if case["requant"]:
            _codes_close(got, want)
        else:
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_weights_with_a_zero_point_stay_in_float_and_stay_right():
    """A DequantizeLinear of int8 weights with a nonzero zero point is no input for the
    symmetric int8 kernels: the conv is left as written (float, the weights
    dequantized at load), and still computes the definition."""
    b = QBuilder(8)
    x = b.qdq("x", 0.04, np.uint8(128))
    w = b.const(b.rng.integers(-100, 100, (5, 3, 3, 3)).astype(np.int8))
    y = b.node("Conv", [x, b.dq(w, np.float32(0.01), np.int8(3))], kernel_shape=[3, 3])
    model = b.model([1, 3, 6, 6], y)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert "QLinearConv" not in _ops(net) and "Conv" in _ops(net)
    x = np.random.default_rng(8).standard_normal((1, 3, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(net(x), run_reference(model, {"x": x})[y], rtol=1e-5, atol=1e-5)


def test_a_qdq_add_that_broadcasts_runs_as_written():
    """Add(DQ(codes), DQ(per-channel constant codes)) -> Q: fused, the operands' shapes
    differ, and the result is the definition's."""
    b = QBuilder(9)
    x = b.qdq("x", 0.04, np.uint8(128))
    shift = b.dq(b.const(np.arange(4, dtype=np.uint8).reshape(4, 1, 1) * 20), np.float32(0.03),
                 np.uint8(10))
    out = b.q(b.node("Add", [x, shift]), 0.05, np.uint8(100))
    model = b.model([2, 4, 3, 5], out, out_dtype=np.uint8)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert "QLinearAdd" in _ops(net)
    x = np.random.default_rng(9).standard_normal((2, 4, 3, 5)).astype(np.float32)
    _codes_close(net(x), run_reference(model, {"x": x})[out])


def _pooling(same):
    """x -> Q -> DQ -> MaxPool (3x3, stride 2, uneven pads, ceil mode) -> Q, the last
    quantizer of the same scale as the first or not."""
    b = QBuilder(6)
    x = b.q("x", 0.05, np.uint8(120))
    pooled = b.node("MaxPool", [b.dq(x, np.float32(0.05), np.uint8(120))], kernel_shape=[3, 3],
                    strides=[2, 2], pads=[1, 1, 1, 0], ceil_mode=1)
    out = b.q(pooled, 0.05 if same else 0.06, np.uint8(120))
    return b.model([2, 3, 8, 9], out, out_dtype=np.uint8), out


@pytest.mark.parametrize("same", [True, False])
def test_max_pooling_between_qdq_pairs_runs_on_the_codes(same):
    """DQ -> MaxPool -> Q of the same scale and zero point pools the codes (exactly the
    definition's codes); with another scale it stays in float, as written."""
    model, out = _pooling(same)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert ("QuantizeLinear" in _ops(net)[1:]) is not same
    x = np.random.default_rng(6).standard_normal((2, 3, 8, 9)).astype(np.float32)
    want = run_reference(model, {"x": x})[out]
    for layout in ("NCHW", "NHWC"):
        plan = net.plan({"x": x}, layouts={s.node.name: layout for s in net.steps})
        assert plan.layouts.count(layout) >= 1
        np.testing.assert_array_equal(net(x), want)


def _qoperator_model(op, x_dtype=np.uint8, seed=0):
    """A one-node QLinearConv / ConvInteger model (3x3, stride 2, uneven pads)."""
    b = QBuilder(seed)
    w = b.const(b.rng.integers(-127, 128, (6, 4, 3, 3)).astype(np.int8))
    zx = x_dtype(3)
    attrs = dict(strides=[2, 2], pads=[1, 0, 2, 1])
    if op == "QLinearConv":
        inputs = ["x", b.const(np.float32(0.03)), b.const(zx), w,
                  b.const(np.linspace(0.005, 0.02, 6).astype(np.float32)),
                  b.const(np.zeros(6, np.int8)), b.const(np.float32(0.2)),
                  b.const(np.uint8(9)), b.const(np.arange(-300, 300, 100).astype(np.int32))]
    else:
        inputs = ["x", w, b.const(zx)]
    out = b.node(op, inputs, **attrs)
    return b.model([2, 4, 9, 8], out, x_dtype=x_dtype,
                   out_dtype=np.uint8 if op == "QLinearConv" else np.int32), out


@pytest.mark.parametrize("op", ["QLinearConv", "ConvInteger"])
@pytest.mark.parametrize("x_dtype", [np.uint8, np.int8])
def test_qoperator_convs_against_the_reference(op, x_dtype):
    model, out = _qoperator_model(op, x_dtype)
    net = tilegemm.load_onnx(model, layout_transform=False)
    info = np.iinfo(x_dtype)
    x = np.random.default_rng(2).integers(info.min, info.max + 1, (2, 4, 9, 8)).astype(x_dtype)
    want = run_reference(model, {"x": x})[out]
    for layout in ("NCHW", "NHWC"):
        got = _layouts(net, x, layout)
        if op == "ConvInteger":
            np.testing.assert_array_equal(got, want)          # exact int32 sums
        else:
            _codes_close(got, want)


def test_integer_products_are_exact():
    rng = np.random.default_rng(3)
    b = QBuilder()
    a = rng.integers(0, 256, (5, 37)).astype(np.uint8)
    w = rng.integers(-128, 128, (37, 11)).astype(np.int8)
    out = b.node("MatMulInteger", ["x", b.const(w), b.const(np.uint8(17)), b.const(np.int8(0))])
    model = b.model([5, 37], out, x_dtype=np.uint8, out_dtype=np.int32, rank=2)
    got = tilegemm.load_onnx(model)(a)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, (a.astype(np.int64) - 17) @ w.astype(np.int64))
    b = QBuilder()
    out = b.node("QLinearMatMul", ["x", b.const(np.float32(0.02)), b.const(np.uint8(17)),
                                   b.const(w), b.const(np.float32(0.01)), b.const(np.int8(0)),
                                   b.const(np.float32(0.3)), b.const(np.uint8(128))])
    model = b.model([5, 37], out, x_dtype=np.uint8, out_dtype=np.uint8, rank=2)
    _codes_close(tilegemm.load_onnx(model)(a), run_reference(model, {"x": a})[out])


def test_quantize_and_dequantize_linear_follow_onnx():
    x = np.array([[-1.0, -0.025, 0.025, 0.075, 1e9, -np.inf, np.nan, 0.0]], np.float32)
    # half to even: -0.5 -> 0, 0.5 -> 0, 1.5 -> 2; saturation; NaN -> the lowest code
    q = quantize_linear(x, np.float32(0.05), np.uint8(10))
    np.testing.assert_array_equal(q, [[0, 10, 10, 12, 255, 0, 0, 10]])
    assert q.dtype == np.uint8
    q8 = quantize_linear(x, np.float32(0.05), np.int8(0))
    np.testing.assert_array_equal(q8, [[-20, 0, 0, 2, 127, -128, -128, 0]])
    np.testing.assert_array_equal(dequantize_linear(q, np.float32(0.5), np.uint8(10)),
                                  (q.astype(np.float32) - 10) * 0.5)
    # int32 codes: a zero point makes the difference wider than float32 holds exactly
    big = np.array([2 ** 31 - 1, -2 ** 31, 2 ** 24 + 1, 7], np.int32)
    for zero in (np.int32(0), np.int32(-3)):
        np.testing.assert_array_equal(dequantize_linear(big, np.float32(0.5), zero),
                                      (big.astype(np.int64) - zero).astype(np.float32)
                                      * np.float32(0.5))
    per_axis = quantize_linear(np.ones((2, 3), np.float32), np.array([1, 0.5, 0.25], np.float32),
                               np.zeros(3, np.int8), axis=1)
    np.testing.assert_array_equal(per_axis, [[1, 2, 4], [1, 2, 4]])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_the_one_pass_add_is_the_three_float32_steps(dtype):
    """QLinearAdd's pass over every pair of codes: bit-identical to DequantizeLinear,
    Add (and Relu) and QuantizeLinear as float32 numpy computes them."""
    info = np.iinfo(dtype)
    codes = np.arange(info.min, info.max + 1).astype(dtype)
    a, b = (v.reshape(-1) for v in np.meshgrid(codes, codes))
    rng = np.random.default_rng(7)
    for relu in (False, True):
        scales = rng.uniform(1e-3, 0.1, 3).astype(np.float32)
        zeros = rng.integers(info.min, info.max + 1, 3)
        out = np.empty(a.size, dtype)
        add_run(a, b, scales, zeros, relu, np.float32(info.min), np.float32(info.max), out)
        y = ((a.astype(np.float32) - np.float32(zeros[0])) * scales[0]
             + (b.astype(np.float32) - np.float32(zeros[1])) * scales[1])
        y = np.maximum(y, np.float32(0)) if relu else y
        want = np.clip(np.rint(y / scales[2]) + np.float32(zeros[2]), info.min, info.max)
        np.testing.assert_array_equal(out, want.astype(dtype))
    # products past float32's range: inf - inf is NaN, which gets the lowest code
    out = np.empty(1, dtype)
    add_run(np.array([info.max], dtype), np.array([info.min], dtype),
            np.array([3e38, 3e38, 1], np.float32), np.array([info.min + 1, info.max - 1, 0]),
            False, np.float32(info.min), np.float32(info.max), out)
    assert out[0] == info.min


def test_unsupported_quantized_forms_are_named_at_load_time():
    model, _ = _qoperator_model("QLinearConv")
    from onnx import numpy_helper
    w_zero = model.graph.node[0].input[5]
    init = next(t for t in model.graph.initializer if t.name == w_zero)
    init.CopyFrom(numpy_helper.from_array(np.full(6, 2, np.int8), w_zero))
    with pytest.raises(NotImplementedError, match="QLinearConv.*symmetric"):
        tilegemm.load_onnx(model)


def test_qlinear_matmul_refuses_a_scale_per_row():
    b = QBuilder()
    w = b.const(np.ones((3, 2), np.int8))
    out = b.node("QLinearMatMul", ["x", b.const(np.full(4, 0.02, np.float32)),
                                   b.const(np.uint8(0)), w, b.const(np.float32(0.01)),
                                   b.const(np.int8(0)), b.const(np.float32(0.3)),
                                   b.const(np.uint8(0))])
    model = b.model([4, 3], out, x_dtype=np.uint8, out_dtype=np.uint8, rank=2)
    with pytest.raises(NotImplementedError, match="QLinearMatMul.*per row"):
        tilegemm.load_onnx(model)


def test_a_qoperator_conv_refuses_codes_of_the_other_signedness():
    model, _ = _qoperator_model("QLinearConv", np.uint8)
    net = tilegemm.load_onnx(model, layout_transform=False)
    with pytest.raises(TypeError, match="must be uint8, got int8"):
        net.run({"x": np.zeros((2, 4, 9, 8), np.int8)})


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
def test_quantized_passes_against_guard_pages():
    """The QuantizeLinear, DequantizeLinear, QLinearAdd, code pooling, global average
    pooling and QGemm steps read no byte past (or before) their operands."""
    for model, shape in ((residual_block(C=3, H=5), (1, 3, 5, 5)), (_pooling(True)[0],
                         (2, 3, 8, 9)), (_classifier_head(True, True, "float")[0], (3, 6, 5, 4))):
        net = tilegemm.load_onnx(model, layout_transform=False)
        x_vals = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
        want = net(x_vals)
        for where in ("after", "before"):
            x = guarded_empty(x_vals.shape, np.float32, where=where)
            x[...] = x_vals
            np.testing.assert_array_equal(net(x), want)
    head = tilegemm.load_onnx(_classifier_head(True, True, "float")[0], layout_transform=False)
    steps = {s.node.op: s.run for s in head.steps}
    for op, shape in (("QLinearGlobalAveragePool", (3, 6, 5, 4)), ("QGemm", (3, 6))):
        codes = np.random.default_rng(7).integers(0, 256, shape).astype(np.uint8)
        want = steps[op](codes)[0]
        for where in ("after", "before"):
            q = guarded_empty(shape, np.uint8, where=where)
            q[...] = codes
            np.testing.assert_array_equal(steps[op](q)[0], want)
    codes = np.random.default_rng(5).integers(0, 256, (2, 5, 6, 3)).astype(np.uint8)
    pooled = pool2d(codes, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), True, "max", layout="NHWC")
    for where in ("after", "before"):
        q = guarded_empty(codes.shape, np.uint8, where=where)
        q[...] = codes
        np.testing.assert_array_equal(dequantize_linear(q, np.float32(2), np.uint8(1)),
                                      (codes.astype(np.float32) - 1) * 2)
        np.testing.assert_array_equal(pool2d(q, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), True,
                                             "max", layout="NHWC"), pooled)
        out = np.empty(codes.size, np.uint8)
        add_run(q.reshape(-1), q.reshape(-1), np.ones(3, np.float32), np.zeros(3, np.int64),
                False, np.float32(0), np.float32(255), out)
        np.testing.assert_array_equal(out, np.minimum(2 * codes.reshape(-1).astype(int), 255))
        for grid, axis in ((q.reshape(2, 30, 3), 1), (q.reshape(2, 5, 18), 2)):
            means = np.empty((2, grid.shape[3 - axis]), np.uint8)
            plane_means(grid, axis == 1, (1, 0.5, 2), (0, 255), means)
            sums = grid.astype(np.int64).sum(axis) - grid.shape[axis]
            np.testing.assert_array_equal(means, np.clip(np.rint(sums * 0.5) + 2, 0, 255))


def test_a_quantized_network_from_several_python_threads():
    """Threads that start on a freshly loaded network (each step planned by whichever
    comes first) get what one thread gets from another copy."""
    model = residual_block(seed=5)
    xs = [np.random.default_rng(i).standard_normal((1, 8, 9, 9)).astype(np.float32)
          for i in range(4)]
    alone = tilegemm.load_onnx(model, layout_transform=False)
    want = [alone(x) for x in xs]
    net = tilegemm.load_onnx(model, layout_transform=False)

    def work(i):
        for _ in range(5):
            np.testing.assert_array_equal(net(xs[i]), want[i])
    in_threads(work, 4)


def _classifier_head(trans_b, per_channel, bias, seed=0):
    """x -> Q/DQ -> GlobalAveragePool -> Q/DQ -> Flatten -> Q/DQ (the same scale) ->
    Gemm (int8 weights behind a DequantizeLinear) -> Q: a QDQ classifier as
    quantize_static writes it."""
    b = QBuilder(seed)
    x = b.qdq("x", 0.05, np.uint8(3))
    pooled = b.qdq(b.node("GlobalAveragePool", [x]), 0.02, np.uint8(5))
    flat = b.qdq(b.node("Flatten", [pooled], axis=1), 0.02, np.uint8(5))
    w = b.rng.integers(-127, 128, (10, 6) if trans_b else (6, 10)).astype(np.int8)
    scale = (b.rng.uniform(0.002, 0.02, 10).astype(np.float32) if per_channel
             else np.float32(0.01))
    zero = np.zeros(10, np.int8) if per_channel else np.int8(0)
    inputs = [flat, b.dq(b.const(w), scale, zero, **(dict(axis=0) if per_channel else {}))]
    if bias == "float":
        inputs.append(b.const(b.rng.normal(0, 0.3, 10).astype(np.float32)))
    elif bias == "int32":
        inputs.append(b.dq(b.const(b.rng.integers(-2000, 2000, 10).astype(np.int32)),
                           np.float32(2e-4), np.int32(0)))
    out = b.q(b.node("Gemm", inputs, transB=int(trans_b)), 0.03, np.uint8(128))
    return b.model([3, 6, 5, 4], out, out_dtype=np.uint8, rank=2), out


@pytest.mark.parametrize("trans_b, per_channel, bias", [
    (True, True, "float"), (False, False, None), (True, False, "int32")])
def test_a_qdq_classifier_head_runs_on_the_codes(trans_b, per_channel, bias):
    """The pooling, the flattening and the Gemm of a QDQ classifier each run in one
    step on the codes (QLinearGlobalAveragePool, Flatten, QGemm on the int8 kernels),
    in both layouts, with the reference's codes."""
    model, out = _classifier_head(trans_b, per_channel, bias)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert _ops(net) == ["QuantizeLinear", "QLinearGlobalAveragePool", "Flatten", "QGemm"]
    x = np.random.default_rng(3).standard_normal((3, 6, 5, 4)).astype(np.float32)
    want = run_reference(model, {"x": x})[out]
    for layout in ("NCHW", "NHWC"):
        plan = net.plan({"x": x}, layouts={s.node.name: layout for s in net.steps
                                           if s.node.op == "QLinearGlobalAveragePool"})
        assert layout in plan.layouts
        _codes_close(net(x), want)


@fuzz_settings(scale=0.3)
@given(st.data())
def test_fuzz_qdq_pooling_and_gemm_on_the_codes(data):
    """A QDQ global average pooling (then Flatten) of random shape and zero points, or
    a QDQ Gemm of random shape, B transposed or not, weight scales per output column,
    per row of B or one, bias forms of every broadcast, requantized or float: on the
    codes where the int8 kernels compute it (in float otherwise), the reference's
    result."""
    draw = data.draw
    b = QBuilder(draw(st.integers(0, 2 ** 16), label="seed"))
    zero = np.int8(draw(st.integers(-128, 127))) if draw(st.booleans()) else np.uint8(
        draw(st.integers(0, 255)))
    requant = draw(st.booleans(), label="requantized")
    if draw(st.booleans(), label="pooling"):
        shape = [draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 6)),
                 draw(st.integers(1, 6))]
        y = b.qdq(b.node("GlobalAveragePool", [b.qdq("x", 0.05, zero)]), 0.011, zero)
        y, ops, requant = b.node("Flatten", [y]), {"QLinearGlobalAveragePool"}, False
    else:
        shape = [draw(st.integers(1, 9)), draw(st.integers(1, 40))]
        n, trans_b = draw(st.integers(1, 20)), draw(st.booleans())
        w = b.rng.integers(-127, 128, (n, shape[1]) if trans_b else (shape[1], n)).astype(np.int8)
        # weight scales per output column (axis 0 of n x k, 1 of k x n), or per row of
        # B (the other axis: stays in float), or one
        axis = draw(st.sampled_from([None, 0, 1]), label="weight scale axis")
        scale = (np.float32(0.01) if axis is None else
                 b.rng.uniform(0.002, 0.02, w.shape[axis]).astype(np.float32))
        inputs = [b.qdq("x", 0.05, zero), b.dq(b.const(w), scale, np.zeros_like(scale, np.int8),
                                                **({} if axis is None else dict(axis=axis)))]
        bias = draw(st.sampled_from(["float", "row", "column", "int32", None]), label="bias")
        shape_b = {"float": (n,), "row": (1, n), "column": (shape[0], 1)}.get(bias)
        if shape_b:                 # (n,), (1, n): per column; (m, 1): per row of the output
            inputs.append(b.const(b.rng.normal(0, 0.3, shape_b).astype(np.float32)))
        elif bias == "int32":
            inputs.append(b.dq(b.const(b.rng.integers(-2000, 2000, n).astype(np.int32)),
                               np.float32(2e-4), np.int32(0)))
        # one scale is one scale, whatever its axis
        fused = ((axis is None or axis == 1 - trans_b or w.shape[axis] == 1)
                 and shape_b in (None, (n,), (1, n)))
        y, ops = b.node("Gemm", inputs, transB=int(trans_b)), {"QGemm" if fused else "Gemm"}
    out = b.q(y, 0.03, np.uint8(128)) if requant else y
    model = b.model(shape, out, out_dtype=np.uint8 if requant else np.float32, rank=2)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert ops <= set(_ops(net)) and not {"GlobalAveragePool", "QGemm" if "Gemm" in ops
                                          else "Gemm"} & set(_ops(net))
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    want = run_reference(model, {"x": x})[out]
    if requant:
        _codes_close(net(x), want)
    else:
        np.testing.assert_allclose(net(x), want, rtol=1e-5, atol=1e-5)


def test_a_qdq_gemm_the_int8_kernels_do_not_take_stays_in_float():
    """A QDQ Gemm with transA (or alpha, or a bias per row) is left as written: the
    float Gemm on the dequantized codes, with the reference's codes."""
    b = QBuilder(4)
    x = b.qdq("x", 0.05, np.uint8(3))
    w = b.dq(b.const(b.rng.integers(-127, 128, (10, 6)).astype(np.int8)), np.float32(0.01),
             np.int8(0))
    out = b.q(b.node("Gemm", [x, w], transA=1, transB=1), 0.03, np.uint8(128))
    model = b.model([6, 4], out, out_dtype=np.uint8, rank=2)
    net = tilegemm.load_onnx(model, layout_transform=False)
    assert "Gemm" in _ops(net) and "QGemm" not in _ops(net)
    x = np.random.default_rng(5).standard_normal((6, 4)).astype(np.float32)
    _codes_close(net(x), run_reference(model, {"x": x})[out])
