"""A float64 reference interpreter of ONNX models, written from the operator
definitions (loops where the definition is a loop), for the network tests.

It reads the ModelProto directly, node by node, with no passes: what tilegemm's
network fuses and folds is checked against the plain definition.
"""
import math

import numpy as np
from onnx import helper, numpy_helper

from reference import reference_conv


def _attrs(node):
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _same_pads(size, k, s, d, upper):
    total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
    small = total // 2
    return (small, total - small) if upper else (total - small, small)


def _pads(at, H, W, kernel):
    strides, dil = at.get("strides", [1, 1]), at.get("dilations", [1, 1])
    auto = at.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        (t, b), (l, r) = (_same_pads(n, k, s, d, auto == "SAME_UPPER")
                          for n, k, s, d in zip((H, W), kernel, strides, dil))
        return t, l, b, r
    if auto == "VALID":
        return 0, 0, 0, 0
    return tuple(at.get("pads", [0, 0, 0, 0]))


def _conv(x, w, b=None, **at):
    t, l, bo, r = _pads(at, x.shape[2], x.shape[3], w.shape[2:])
    return reference_conv(x, w, b, stride=tuple(at.get("strides", [1, 1])),
                          dilation=tuple(at.get("dilations", [1, 1])), padding=(t, bo, l, r),
                          groups=at.get("group", 1))


def _pool(x, at, kind):
    """Pooling by its definition: every output position, every window element."""
    kh, kw = at["kernel_shape"]
    sy, sx = at.get("strides", [1, 1])
    dy, dx = at.get("dilations", [1, 1])
    N, C, H, W = x.shape
    t, l, bo, r = _pads(at, H, W, (kh, kw))
    ceil = at.get("ceil_mode", 0)

    def size(n, b, e, k, s, d):
        span = (k - 1) * d + 1
        o = (math.ceil if ceil else math.floor)((n + b + e - span) / s) + 1
        return o - 1 if ceil and (o - 1) * s >= n + b else o
    Ho, Wo = size(H, t, bo, kh, sy, dy), size(W, l, r, kw, sx, dx)
    out = np.zeros((N, C, Ho, Wo))
    for i in range(Ho):
        for j in range(Wo):
            vals, count = [], 0
            for u in range(kh):
                for v in range(kw):
                    y, z = i * sy + u * dy - t, j * sx + v * dx - l
                    inside = 0 <= y < H and 0 <= z < W
                    in_pads = -t <= y < H + bo and -l <= z < W + r
                    if inside:
                        vals.append(x[:, :, y, z])
                    count += inside or (in_pads and at.get("count_include_pad", 0))
            stack = np.stack(vals)
            out[:, :, i, j] = stack.max(0) if kind == "max" else stack.sum(0) / count
    return out


def _matmul(a, b):
    return np.matmul(a, b)


def _along(v, x, axis):
    v = np.asarray(v)
    return v.reshape([-1 if i == axis % x.ndim else 1 for i in range(x.ndim)]) if v.size > 1 else v


def _quantize(v, s, z=None, axis=1):
    """QuantizeLinear by its definition, in float32 as it is for a float32 input."""
    dtype = np.uint8 if z is None else z.dtype
    info = np.iinfo(dtype)
    y = np.rint(np.float32(v) / _along(s, v, axis).astype(np.float32))
    y = y + (0 if z is None else _along(z, v, axis).astype(np.float64))
    return np.clip(y, info.min, info.max).astype(dtype)


def _dequantize(q, s, z=None, axis=1):
    z = 0 if z is None else _along(z, q, axis).astype(np.int64)
    return (q.astype(np.int64) - z) * _along(s, q, axis).astype(np.float64)


def _qlinear_conv(x, xs, xz, w, ws, wz, ys, yz, b=None, **at):
    """QLinearConv: the real conv of the dequantized operands, int32 bias in units of
    x_scale * w_scale, requantized (float64, then rounded)."""
    ws = np.asarray(ws, np.float64).reshape(-1)
    real_b = None if b is None else b * float(xs) * (ws if ws.size > 1 else ws[0])
    y = _conv(_dequantize(x, xs, xz), _dequantize(w, ws, wz, axis=0), real_b, **at)
    info = np.iinfo(yz.dtype)
    return np.clip(np.rint(y / float(ys)) + float(yz), info.min, info.max).astype(yz.dtype)


def _conv_integer(x, w, xz=None, wz=None, **at):
    sums = _conv(_dequantize(x, 1.0, xz), _dequantize(w, 1.0, wz), **at)
    return np.rint(sums).astype(np.int32)              # integers below 2^53: exact


def _qlinear_matmul(a, as_, az, b, bs, bz, ys, yz):
    y = (_dequantize(a, as_, az) @ _dequantize(b, bs, bz, axis=-1))
    info = np.iinfo(yz.dtype)
    return np.clip(np.rint(y / float(ys)) + float(yz), info.min, info.max).astype(yz.dtype)


QUANTIZED = {
    "QuantizeLinear": lambda at: lambda v, s, z=None: _quantize(v, s, z, at.get("axis", 1)),
    "DequantizeLinear": lambda at: lambda q, s, z=None: _dequantize(q, s, z, at.get("axis", 1)),
    "QLinearConv": lambda at: lambda *x: _qlinear_conv(*x, **at),
    "ConvInteger": lambda at: lambda *x: _conv_integer(*x, **at),
    "MatMulInteger": lambda at: lambda a, b, az=None, bz=None: (
        (a.astype(np.int64) - (0 if az is None else az.astype(np.int64)))
        @ (b.astype(np.int64) - (0 if bz is None else bz.astype(np.int64)))).astype(np.int32),
    "QLinearMatMul": lambda at: _qlinear_matmul,
}


def _op(node, x, at):
    op = node.op_type
    if op in QUANTIZED:
        return [QUANTIZED[op](at)(*x)]
    if op == "Conv":
        return [_conv(*x, **at)]
    if op == "BatchNormalization":
        v, g, b, m, var = x
        s = (1, -1) + (1,) * (v.ndim - 2)
        return [(v - m.reshape(s)) / np.sqrt(var.reshape(s) + at.get("epsilon", 1e-5))
                * g.reshape(s) + b.reshape(s)]
    if op in ("MaxPool", "AveragePool"):
        return [_pool(x[0], at, "max" if op == "MaxPool" else "avg")]
    elementwise = {
        "Relu": lambda v: np.where(v < 0, 0, v),
        "Clip": lambda v, lo=None, hi=None: np.where(v < lo, lo, np.where(v > hi, hi, v)),
        "LeakyRelu": lambda v: np.where(v < 0, at.get("alpha", 0.01) * v, v),
        "Sigmoid": lambda v: 1 / (1 + np.exp(-v)),
        "HardSigmoid": lambda v: np.clip(at.get("alpha", 0.2) * v + at.get("beta", 0.5), 0, 1),
        "HardSwish": lambda v: v * np.clip(v / 6 + 0.5, 0, 1),
        "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide,
        "Identity": lambda v: v, "Dropout": lambda v, *r: v,
        "GlobalAveragePool": lambda v: v.mean(axis=(2, 3), keepdims=True),
        "GlobalMaxPool": lambda v: v.max(axis=(2, 3), keepdims=True),
        "Flatten": lambda v: v.reshape(int(np.prod(v.shape[:at.get("axis", 1)])), -1),
        "MatMul": _matmul,
        "Shape": lambda v: np.array(v.shape, np.int64),
        "Gather": lambda v, i: np.take(v, i, axis=at.get("axis", 0)),
        "Unsqueeze": lambda v, a: np.expand_dims(v, tuple(int(i) for i in a)),
        "Concat": lambda *vs: np.concatenate(vs, axis=at["axis"]),
        "Reshape": lambda v, s: v.reshape([v.shape[i] if d == 0 else d for i, d in enumerate(s)]),
        "Transpose": lambda v: v.transpose(at["perm"]),
    }
    if op in elementwise:
        return [elementwise[op](*x)]
    if op == "Gemm":
        a, b = x[0], x[1]
        a = a.T if at.get("transA", 0) else a
        b = b.T if at.get("transB", 0) else b
        y = at.get("alpha", 1.0) * (a @ b)
        return [y + at.get("beta", 1.0) * x[2] if len(x) > 2 else y]
    if op == "Softmax":
        e = np.exp(x[0] - x[0].max(axis=at.get("axis", -1), keepdims=True))
        return [e / e.sum(axis=at.get("axis", -1), keepdims=True)]
    if op == "Pad":
        pads = list(x[1])
        half = len(pads) // 2
        return [np.pad(x[0], list(zip(pads[:half], pads[half:])), mode=at.get("mode", "constant"))]
    raise NotImplementedError(op)


def run_reference(model, feeds):
    """``{output name: float64 array}`` of ``model`` for ``feeds`` ({name: array})."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    values = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in values.items()}
    values.update({k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else
                   np.asarray(v) for k, v in feeds.items()})
    for node in model.graph.node:
        result = _op(node, [values[n] for n in node.input if n], _attrs(node))
        values.update(zip(node.output, result))
    return {o.name: values[o.name] for o in model.graph.output}
