"""Differential fuzzing of whole networks against the float64 reference interpreter.

Each example builds a random small ONNX model: convs of every geometry (grouped,
depthwise, dilated, strided, uneven and SAME_UPPER pads, with or without bias),
BatchNorm + activation, pooling of every form, residual Adds and Concats reaching
back to any earlier tensor (branches and joins), optionally a head (global pool,
flatten, Gemm).  It runs under the layout DP's plan, the all-NCHW plan and a plan
with every step that can in NHWC, and must match the reference.
"""
import numpy as np
import pytest
from hypothesis import assume, given, note, strategies as st

pytest.importorskip("onnx")

import tilegemm  # noqa: E402
from fuzz_settings import fuzz_settings  # noqa: E402
from net_reference import run_reference  # noqa: E402
from tilegemm.tools.zoo import Builder  # noqa: E402

ACTIVATIONS = (None, "Relu", "Relu6", "LeakyRelu", "HardSwish", "Sigmoid")


def _conv(draw, b, src, C, H, W):
    """A conv layer on ``src``; returns (name, channels, H, W)."""
    groups = draw(st.sampled_from([g for g in (1, 1, 2, 3, C) if C % g == 0]))
    K = groups * draw(st.integers(1, 3 if groups > 1 else 8))
    k = draw(st.sampled_from((1, 3, 3, 5)))
    s, d = draw(st.integers(1, 2)), draw(st.sampled_from((1, 1, 2)))
    attrs = dict(strides=[s, s], dilations=[d, d])
    if draw(st.booleans()) and d == 1:
        attrs["auto_pad"] = "SAME_UPPER"
        Ho, Wo = -(-H // s), -(-W // s)
    else:
        pads = [draw(st.integers(0, 2)) for _ in range(4)]
        attrs["pads"] = pads
        span = d * (k - 1) + 1
        Ho, Wo = (H + pads[0] + pads[2] - span) // s + 1, (W + pads[1] + pads[3] - span) // s + 1
    assume(Ho >= 1 and Wo >= 1)
    act = draw(st.sampled_from(ACTIVATIONS))
    if draw(st.booleans()):
        y = b.conv_bn(src, C, K, k, act=act, groups=groups, **attrs)
    else:
        y = b.conv(src, C, K, k, bias=draw(st.booleans()), groups=groups, **attrs)
        y = y if act is None else (b.clip6(y) if act == "Relu6" else b.op(act, [y]))
    return y, K, Ho, Wo


def _pool(draw, b, src, C, H, W):
    k = draw(st.integers(1, 3))
    s = draw(st.integers(1, 2))
    pads = [draw(st.integers(0, k - 1)) for _ in range(4)]
    ceil = draw(st.integers(0, 1))
    span_h, span_w = H + pads[0] + pads[2] - k, W + pads[1] + pads[3] - k
    assume(span_h >= 0 and span_w >= 0)
    size = [(n // s + 1) if not ceil else -(-n // s) + 1 for n in (span_h, span_w)]
    for i, (n, p) in enumerate(((H, pads[0]), (W, pads[1]))):
        if ceil and (size[i] - 1) * s >= n + p:
            size[i] -= 1
    if draw(st.booleans()):
        y = b.op("MaxPool", [src], kernel_shape=[k, k], strides=[s, s], pads=pads, ceil_mode=ceil)
    else:
        y = b.op("AveragePool", [src], kernel_shape=[k, k], strides=[s, s], pads=pads,
                 ceil_mode=ceil, count_include_pad=draw(st.integers(0, 1)))
    return y, C, size[0], size[1]


@st.composite
def networks(draw):
    """(model, input shape) of a random small network."""
    b = Builder(seed=draw(st.integers(0, 2 ** 16)))
    N, C = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    H, W = draw(st.integers(3, 10)), draw(st.integers(3, 10))
    tensors = [("x", C, H, W)]
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(("conv", "conv", "pool", "join")))
        src = draw(st.sampled_from(tensors))
        if kind == "join":
            partners = [t for t in tensors if t[2:] == src[2:] and t is not src]
            if partners:
                other = draw(st.sampled_from(partners))
                if other[1] == src[1] and draw(st.booleans()):
                    y = b.op("Add", [other[0], src[0]])
                    y = b.op("Relu", [y]) if draw(st.booleans()) else y
                    tensors.append((y,) + src[1:])
                else:
                    y = b.op("Concat", [src[0], other[0]], axis=1)
                    tensors.append((y, src[1] + other[1]) + src[2:])
                continue
            kind = "conv"
        tensors.append((_conv if kind == "conv" else _pool)(draw, b, *src))
    y, C, H, W = tensors[-1]
    if draw(st.booleans()):
        y = b.op("Flatten", [b.op("GlobalAveragePool", [y])])
        y = b.op("Gemm", [y, b.random(5, C), b.random(5, scale=0.1)], transB=1)
        return b.model([N, tensors[0][1], tensors[0][2], tensors[0][3]], [(y, 2)]), tensors[0]
    return b.model([N, tensors[0][1], tensors[0][2], tensors[0][3]], [(y, 4)]), tensors[0]


@fuzz_settings(scale=0.25)
@given(net=networks(), plan=st.sampled_from(("dp", "nchw", "nhwc")), seed=st.integers(0, 99))
def test_networks_match_the_reference(net, plan, seed):
    model, (_, C, H, W) = net
    shape = tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    note(f"ops: {[n.op_type for n in model.graph.node]}, plan {plan}")
    network = tilegemm.load_onnx(model, layout_transform=plan != "nchw")
    if plan == "nhwc":
        every = network.plan({"x": x})
        network.plan({"x": x}, every.single("NHWC"))
    # The first run records the shapes, the second runs on reused buffers and records
    # what it did, the third replays that on new values.
    x_new = np.random.default_rng(seed + 100).standard_normal(shape).astype(np.float32)
    for x in (x, x, x_new):
        before = x.copy()
        expected = run_reference(model, {"x": x})[model.graph.output[0].name]
        scale = max(float(np.max(np.abs(expected))), 1e-3)
        got = network(x)
        np.testing.assert_array_equal(x, before)
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4 * scale)
