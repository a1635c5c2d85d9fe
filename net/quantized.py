"""The quantized operators of a network, on the exact int8 kernels.

ONNX writes a quantized model in one of two forms, and both run here:

* **QOperator**: QLinearConv, QLinearMatMul, ConvInteger and MatMulInteger take
  int8/uint8 codes and give codes (or int32 sums).  They run on
  :func:`tilegemm.qconv2d` / :func:`tilegemm.qmatmul`: int32 sums exact, the
  scales, bias and requantization in one epilogue.
* **QDQ** (what onnxruntime's ``quantize_static`` writes by default): float
  operators between QuantizeLinear / DequantizeLinear, the weights int8
  initializers behind a DequantizeLinear.  The pass
  :func:`tilegemm.net.passes.fuse_qdq` rewrites each Conv reading dequantized codes
  into a QLinearConv on those codes, so activations stay int8 from conv to conv;
  what it leaves runs as written (QuantizeLinear / DequantizeLinear here, the rest
  in float).

The fused QLinearConv may carry two forms ONNX's does not: a float32 bias in the
output's real units (a QDQ Conv's bias, where ONNX's is int32 in units of
``x_scale * w_scale``) and no ``y_scale`` (a float32 output, when no QuantizeLinear
follows the conv).  The int8 kernels take symmetric int8 weights (zero points 0), as
``quantize_static`` writes them by default: a QDQ conv with other weights stays in
float, a QLinearConv or ConvInteger with them is refused at load time.
"""
import numba
import numpy as np

from tilegemm.conv.qconv import PreparedQConv, QConvWeights, QuantizedSum
from tilegemm.conv.quant import RANGES, qmatmul
from tilegemm.ground.contracts import CACHE
from tilegemm.kernels.pool import for_slices
from tilegemm.kernels.qgemm import runnable_int8_kinds
from tilegemm.kernels.requant import add_codes as add_run
from tilegemm.net.layers import LAYOUTS, SPATIAL, in_layouts, window
from tilegemm.net.ops import elementwise, first, writes_into
from tilegemm.net.registry import operator, unsupported

#: The attributes of a convolution node (Conv, QLinearConv, ConvInteger).
CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def along(value, x, axis):
    """A scale or zero point shaped to broadcast against ``x``: as is when it is one
    value, else laid along ``axis``."""
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    shape = [1] * x.ndim
    shape[axis % x.ndim] = -1
    return value.reshape(shape)


#: Without fastmath: ``x / scale`` must divide (not multiply by a reciprocal) to round
#: as ONNX's QuantizeLinear does, and NaN must be seen.
_exact = numba.njit(nogil=True, cache=CACHE, fastmath=False)


@_exact
def quantize_run(x, scale, zero, low, high, out):
    """``out = clip(rint(x / scale) + zero, low, high)`` over 1-D runs, float32
    arithmetic; NaN gets ``low``."""
    for i in range(x.size):
        y = np.rint(np.float32(x[i]) / scale) + zero
        if not y >= low:
            y = low
        elif y > high:
            y = high
        out[i] = y


@_exact
def dequantize_run(q, scale, zero, out):
    """``out = (q - zero) * scale`` over 1-D runs, as float32; the codes and the zero
    point float32 exactly (see :func:`dequantize_linear`), which vectorises (see
    :func:`add_run`)."""
    zf = np.float32(zero)
    for i in range(q.size):
        out[i] = (np.float32(q[i]) - zf) * scale


@_exact
def plane_means(x, by_rows, scaling, limits, out):
    """``out[n, c] = clip(rint((sum - count * zx) * m) + zy)`` for ``scaling = (zx, m,
    zy)``, ``sum`` the int64 sum of channel c's ``count`` codes in image n: ``x`` is
    (N, count, C) with ``by_rows``, else (N, C, count)."""
    zx, m, zy = scaling
    N, C = out.shape
    count = x.shape[1] if by_rows else x.shape[2]
    sums = np.zeros(C, np.int64)
    for n in range(N):
        sums[:] = 0
        if by_rows:
            for p in range(count):
                for c in range(C):
                    sums[c] += x[n, p, c]
        else:
            for c in range(C):
                for p in range(count):
                    sums[c] += x[n, c, p]
        for c in range(C):
            y = np.rint((sums[c] - count * zx) * m) + zy
            out[n, c] = min(max(y, limits[0]), limits[1])


def _runs(fn, x, out, *args):
    """``fn(x run, *args, out run)`` over C-contiguous ``x`` and ``out`` flattened, the
    threads taking runs."""
    xf, of = np.ascontiguousarray(x).reshape(-1), out.reshape(-1)
    for_slices(lambda part: fn(xf[part], *args, of[part]), xf.size, xf.size)
    return out


def _target(out, shape, dtype):
    """``out`` if it is a C-contiguous array to write into, else a new one."""
    if out is not None and out.flags.c_contiguous and out.shape == shape and out.dtype == dtype:
        return out
    return np.empty(shape, dtype)


def quantize_linear(x, scale, zero_point, axis=1, out=None):
    """ONNX QuantizeLinear: ``saturate(rint(x / scale) + zero_point)`` in float32
    arithmetic (round half to even), as the zero point's dtype (uint8 without one).
    NaN gets the lowest code and infinities saturate (NaN has no code)."""
    dtype = np.dtype(np.uint8) if zero_point is None else zero_point.dtype
    low, high = RANGES[dtype]
    if np.size(scale) == 1 and (zero_point is None or zero_point.size == 1):
        zero = 0.0 if zero_point is None else float(zero_point.reshape(()))
        result = _target(out, x.shape, dtype)
        return _runs(quantize_run, x, result, np.float32(np.ravel(scale)[0]), np.float32(zero),
                     np.float32(low), np.float32(high))
    s = along(scale, x, axis).astype(np.float32)
    y = np.rint(np.divide(x, s, dtype=np.float32))
    if zero_point is not None:
        y += along(zero_point, x, axis).astype(np.float32)
    np.fmax(y, np.float32(low), out=y)
    np.fmin(y, np.float32(high), out=y)
    return y.astype(dtype)


def dequantize_linear(q, scale, zero_point=None, axis=1, out=None):
    """ONNX DequantizeLinear: ``(q - zero_point) * scale`` as float32."""
    zero = 0 if zero_point is None or zero_point.size != 1 else int(zero_point.reshape(()))
    # dequantize_run's float32 difference is exact for 8- and 16-bit codes, and for
    # int32 codes with no zero point
    exact = q.dtype.itemsize <= 2 or zero == 0
    if np.size(scale) == 1 and (zero_point is None or zero_point.size == 1) and exact:
        return _runs(dequantize_run, q, _target(out, q.shape, np.float32),
                     np.float32(np.ravel(scale)[0]), np.int64(zero))
    z = 0 if zero_point is None else along(zero_point, q, axis).astype(np.int64)
    return (q.astype(np.int64) - z).astype(np.float32) * along(scale, q, axis).astype(np.float32)


def _scale_zero(node, const, names, what):
    """The constant scalar scale (positive, finite) and zero point (or None) of ``what``."""
    scale = const(names[0]) if names[0] else None
    zero = const(names[1]) if len(names) > 1 and names[1] else None
    if scale is None or scale.size != 1 or (len(names) > 1 and names[1] and zero is None):
        raise unsupported(node, f"{what}'s scale and zero point must be constant scalars")
    if zero is not None and (zero.size != 1 or zero.dtype not in RANGES):
        raise unsupported(node, f"{what}'s zero point must be one int8 or uint8 value, got "
                                f"{zero.dtype} of shape {zero.shape}")
    value = float(scale.reshape(()))
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"node {node.name!r} ({node.op}): {what}'s scale must be positive and "
                         f"finite, got {value}")
    return value, zero


def _per_tensor(node, const):
    """Whether ``node``'s scale and zero point are constants of one value each."""
    return all(const(n) is not None and const(n).size == 1 for n in node.inputs[1:] if n)


@operator("QuantizeLinear", ("axis", "saturate"))
def _quantize_linear(node, const):
    axis = node.attrs.get("axis", 1)

    def run(x, scale, zero_point=None, out=None):
        if x.dtype.kind != "f":
            raise TypeError(f"node {node.name!r} (QuantizeLinear): float input expected, got "
                            f"{x.dtype}")
        return (quantize_linear(x, scale, zero_point, axis, first(out)),)
    return writes_into(elementwise(run)) if _per_tensor(node, const) else run


@operator("DequantizeLinear", ("axis",))
def _dequantize_linear(node, const):
    axis = node.attrs.get("axis", 1)

    def run(q, scale, zero_point=None, out=None):
        if q.dtype not in RANGES and q.dtype != np.int32:
            raise TypeError(f"node {node.name!r} (DequantizeLinear): int8, uint8 or int32 "
                            f"input expected, got {q.dtype}")
        return (dequantize_linear(q, scale, zero_point, axis, first(out)),)
    return writes_into(elementwise(run)) if _per_tensor(node, const) else run


def qdq_add(a, a_q, b, b_q, relu, y_q):
    """ONNX's DequantizeLinear of ``a`` and of ``b``, Add (broadcasting), [Relu] and
    QuantizeLinear, as written; ``a_q``, ``b_q``, ``y_q``: ``(scale, zero point or
    None)``."""
    y = dequantize_linear(a, *a_q) + dequantize_linear(b, *b_q)
    return quantize_linear(np.maximum(y, 0) if relu else y, *y_q)


@operator("QLinearAdd")
def _qlinear_add(node, const):
    """``Q(DQ(a) + DQ(b))`` (a Relu between, when the passes fused one) in one pass:
    what :func:`tilegemm.net.passes.fuse_qdq_add` makes of a QDQ model's residual sum
    (com.microsoft's QLinearAdd has these inputs).  Operands that broadcast run the
    three steps as written."""
    params = [_scale_zero(node, const, node.inputs[i:i + 2], what)
              for i, what in ((1, "a"), (4, "b"), (6, "y"))]
    scales = np.array([p[0] for p in params], np.float32)
    zeros = np.array([0 if p[1] is None else int(p[1].reshape(())) for p in params], np.int64)
    dtype = np.dtype(np.uint8) if params[2][1] is None else params[2][1].dtype
    low, high = (np.float32(v) for v in RANGES[dtype])
    relu = node.epilogue.get("activation") == "relu"

    def run(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero=None, out=None):
        if a.shape != b.shape:           # broadcast: the three steps as written
            return (qdq_add(a, (a_scale, a_zero), b, (b_scale, b_zero), relu,
                            (y_scale, y_zero)),)
        result = _target(first(out), a.shape, dtype)
        bf = np.ascontiguousarray(b).reshape(-1)
        af, of = np.ascontiguousarray(a).reshape(-1), result.reshape(-1)
        for_slices(lambda part: add_run(af[part], bf[part], scales, zeros, relu, low, high,
                                        of[part]), af.size, af.size)
        return (result,)
    return writes_into(elementwise(run))


@operator("QLinearGlobalAveragePool", ("channels_last",))
def _qlinear_global_average_pool(node, const):
    """``Q(mean(DQ(x)))`` over each channel's plane in one pass over the codes: what
    :func:`tilegemm.net.passes.fuse_qdq_global_pool` makes of a QDQ model's pooling
    (com.microsoft's operator, its input in the graph's NCHW: ``channels_last = 0``).
    The codes' sum is exact (int64), the scaling and rounding in float64."""
    if node.attrs.get("channels_last", 0):
        raise unsupported(node, "channels_last=1 (NCHW input expected)")
    x_scale, x_zero = _scale_zero(node, const, node.inputs[1:3], "x")
    y_scale, y_zero = _scale_zero(node, const, node.inputs[3:5], "y")
    zx, zy = (0 if z is None else int(z.reshape(())) for z in (x_zero, y_zero))
    dtype = np.dtype(np.uint8) if y_zero is None else y_zero.dtype
    low, high = RANGES[dtype]

    def pooled(layout):
        def run(x, *_, out=None):
            nhwc = layout == "NHWC"
            if x.ndim < 3 or nhwc and x.ndim != 4 or x.dtype not in RANGES:
                raise TypeError(f"node {node.name!r} (QLinearGlobalAveragePool): int8 or uint8 "
                                f"codes of at least 3 dimensions (4 in NHWC) expected, got "
                                f"{x.ndim}-D {x.dtype}")
            n, c = x.shape[0], x.shape[3 if nhwc else 1]
            count = x.size // max(n * c, 1)
            shape = (n, 1, 1, c) if nhwc else (n, c) + (1,) * (x.ndim - 2)
            result = _target(first(out), shape, dtype)
            # (N, pixels, C) summed over its rows, or (N, C, pixels) over its columns
            grid = np.ascontiguousarray(x).reshape((n, count, c) if nhwc else (n, c, count))
            plane_means(grid, nhwc, (zx, float(x_scale) / (count * float(y_scale)), zy),
                        (low, high), result.reshape(n, c))
            return (result,)
        return run
    return writes_into(in_layouts({layout: pooled(layout) for layout in LAYOUTS}))


# --------------------------------------------------------------------------- convolutions
def _int8_weights(node, const, name, zero_name):
    """The constant symmetric int8 weights of a quantized product or conv."""
    w = const(name) if name else None
    if w is None or w.dtype != np.int8:
        raise unsupported(node, "the weights must be a constant int8 tensor "
                                f"(got {'a computed tensor' if w is None else w.dtype})")
    zero = const(zero_name) if zero_name else None
    if zero_name and (zero is None or np.any(zero != 0)):
        raise unsupported(node, "only symmetric weights (zero points 0) are supported")
    return w


class QConvStep:
    """A QLinearConv (or ConvInteger, or with ``matrix`` a QGemm) of a network: weights
    prepared once (:class:`~tilegemm.QConvWeights`), run by :func:`~tilegemm.qconv2d`
    in NCHW or NHWC; the activation the passes fused in (``node.epilogue``) before
    rounding.  A QGemm ``A @ B + C`` runs as the 1x1 convolution of A's rows as
    pixels (:meth:`run_matrix`)."""

    def __init__(self, node, const, integer=False, matrix=False):
        names = list(node.inputs) + [""] * 9
        if matrix:          # QGemm: A, a_scale, a_zero, B, b_scale, b_zero, C, y_scale, y_zero
            names = names[:6] + names[7:9] + [names[6]]
        self.node, self.integer, self.matrix = node, integer, matrix
        if integer:                     # ConvInteger: x, w, x_zero_point, w_zero_point
            w = _int8_weights(node, const, names[1], names[3])
            self.x_scale, self.x_zero = 1.0, const(names[2]) if names[2] else None
            if names[2] and self.x_zero is None:
                raise unsupported(node, "x_zero_point must be a constant")
            self.weights = QConvWeights(w, 1.0)
            self.bias = self.out_scale = self.out_zero = None
        else:
            w = _int8_weights(node, const, names[3], names[5])
            w = _matrix_as_kernel(node, w) if matrix else w
            self.x_scale, self.x_zero = _scale_zero(node, const, names[1:3], "x")
            w_scale = const(names[4]) if names[4] else None
            if w_scale is None:
                raise unsupported(node, "w_scale must be a constant")
            self.weights = QConvWeights(w, w_scale.astype(np.float64).reshape(-1)
                                        if w_scale.size > 1 else float(w_scale.reshape(())))
            self.out_scale, self.out_zero = (_scale_zero(node, const, names[6:8], "y")
                                             if names[6] else (None, None))
            self.bias = self._bias(const, names[8])
        self.kernel = w.shape[2:]
        self.strides, self.dilations, self.pads = window(node, self.kernel)
        self.groups = int(node.attrs.get("group", 1))
        self.act = node.epilogue.get("activation")
        self.sum = self._sum(const, names[9:14]) if "sum" in node.epilogue else None
        # a constant residual is given as written, NCHW (the network converts activations)
        self.constant_residual = self.sum is not None and const(names[9]) is not None
        # (input shape, dtype, layout, the residual's dtype or None) -> what _prepare returns
        self.calls = {}

    def _sum(self, const, names):
        """The :class:`~tilegemm.conv.qconv.QuantizedSum` of a residual sum the passes
        fused in (:func:`tilegemm.net.passes.fuse_qconv_sum`): inputs residual,
        its scale and zero point, the sum's."""
        (r_scale, r_zero), (s_scale, s_zero) = (
            _scale_zero(self.node, const, names[i:i + 2], what)
            for i, what in ((1, "the residual"), (3, "the sum")))
        # no zero point: the residual's codes are of its own dtype, the sum's uint8 (ONNX)
        typed = [None if r_zero is None else r_zero.reshape(())[()],
                 np.uint8(0) if s_zero is None else s_zero.reshape(())[()]]
        epilogue = self.node.epilogue["sum"]
        return QuantizedSum(r_scale, typed[0], s_scale, typed[1], epilogue["activation"],
                            epilogue["conv_first"])

    def _sum_for(self, dtype):
        """The :class:`~tilegemm.conv.qconv.QuantizedSum` for a residual of ``dtype``
        (None: no sum), its zero point that dtype's 0 where the model gives none."""
        if dtype is None:
            return None
        s = self.sum
        return s if s.zero_point is not None else s._replace(zero_point=dtype.type(0))

    def _bias(self, const, name):
        """The bias in the output's real units: ONNX's int32 one scaled by x_scale *
        w_scale, a float one (fused from QDQ) as it is."""
        if not name:
            return None
        b = const(name)
        if b is None or b.ndim != 1:
            raise unsupported(self.node, "the bias must be a constant 1-D tensor")
        if b.dtype == np.int32:
            return b.astype(np.float64) * self.x_scale * self.weights.scales
        if b.dtype.kind == "f":
            return b.astype(np.float64)
        raise unsupported(self.node, f"a bias of dtype {b.dtype} (int32 or float expected)")

    def run(self, x, layout, out=None, residual=None):
        """The output codes (or float32 / int32 values) for input codes ``x``, into
        ``out`` when it fits (checked and planned once per input shape); with a fused
        sum, summed with ``residual``'s codes."""
        if self.constant_residual and layout == "NHWC":
            residual = np.asarray(residual)
            residual = residual.reshape((1,) * (4 - residual.ndim) + residual.shape).transpose(
                0, 2, 3, 1)
        # a residual that broadcasts: the conv's codes, then the three steps as written
        summed = residual is not None and residual.shape == self._output_shape(x, layout)
        key = (x.shape, x.dtype, layout, residual.dtype if summed else None)
        call = self.calls.get(key)
        if call is None:
            call = self.calls[key] = self._prepare(x, layout, residual.dtype if summed else None)
        conv, width, zero = call
        if width is not None:                     # uneven pads: the zero point padded
            x = np.pad(x, width, constant_values=zero)
        if summed:
            return (conv(x, out, residual),)
        if residual is None:
            return (conv(x, out),)
        s = self.sum
        operands = [(conv(x), (np.float32(self.out_scale), self.out_zero)),
                    (residual, (np.float32(s.scale), None if s.zero_point is None
                                else np.asarray(s.zero_point)))]
        (a, a_q), (b, b_q) = operands if s.conv_first else operands[::-1]
        return (qdq_add(a, a_q, b, b_q, s.activation == "relu",
                        (np.float32(s.out_scale), np.asarray(s.out_zero_point))),)

    def _output_shape(self, x, layout):
        """The conv's output shape for input ``x`` in ``layout`` (of its plain call)."""
        key = (x.shape, x.dtype, layout, None)
        if key not in self.calls:
            self.calls[key] = self._prepare(x, layout)
        return self.calls[key][0].output_shape

    def _prepare(self, x, layout, summed=None):
        """``(PreparedQConv, padding widths or None, zero point)`` for inputs like ``x``
        (with ``summed``, the residual's dtype, its residual sum fused in)."""
        node = self.node
        zero = 0 if self.x_zero is None else self.x_zero.reshape(()).item()
        if self.x_zero is not None and x.dtype != self.x_zero.dtype:
            raise TypeError(f"node {node.name!r} ({node.op}): input of dtype {x.dtype} with a "
                            f"zero point of dtype {self.x_zero.dtype}")
        if x.dtype not in RANGES:
            raise TypeError(f"node {node.name!r} ({node.op}): int8 or uint8 input expected, "
                            f"got {x.dtype}")
        ay, ax = SPATIAL[layout]
        top, left, bottom, right = self.pads(x.shape[ay], x.shape[ax])
        shape, padding, width = list(x.shape), (top, left), None
        if (top, left) != (bottom, right):
            width = [(0, 0)] * 4
            width[ay], width[ax] = (top, bottom), (left, right)
            shape[ay], shape[ax] = shape[ay] + top + bottom, shape[ax] + left + right
            padding = 0
        # ONNX's y_zero_point gives the output's dtype (uint8 without one)
        out_zero = np.uint8(0) if self.out_zero is None else self.out_zero.reshape(())[()]
        options = dict(x_zero_point=zero, stride=self.strides, padding=padding,
                       dilation=self.dilations, groups=self.groups, layout=layout)
        if not self.integer:
            options.update(activation=self.act, out_scale=self.out_scale, out_zero_point=out_zero)
        try:
            conv = PreparedQConv(tuple(shape), x.dtype, self.x_scale, self.weights, self.bias,
                                 residual=self._sum_for(summed), **options)
        except (TypeError, ValueError) as err:
            raise type(err)(f"node {node.name!r} ({node.op}): {err}") from err
        if self.integer:   # ConvInteger: unit scales and no bias write the sums themselves
            conv.out_dtype = np.dtype(np.int32)
        return conv, width, zero

    def run_matrix(self, a, out=None):
        """The QGemm of the 2-D codes ``a`` (m x k): the 1x1 convolution of m pixels
        of k channels, into ``out`` (m x n) when it fits."""
        if a.ndim != 2:
            raise ValueError(f"node {self.node.name!r} (QGemm): a 2-D A expected, got {a.ndim}-D")
        m = a.shape[0]
        n = self.weights.shape[0]
        # one NHWC image of m pixels (A's and the output's memory as they are): its
        # threads share the pixels, each streaming the weights once (as m images of
        # one pixel each, every pixel streamed them: 4.7x slower at m = 32)
        pixels = out.reshape(1, m, 1, n) if out is not None and out.shape == (m, n) else None
        return (self.run(np.ascontiguousarray(a).reshape(1, m, 1, -1), "NHWC",
                         pixels)[0].reshape(m, n),)

    def describe(self, layout, x_shape, *_):
        """("qconv2d", operations) for an input of ``x_shape`` in ``layout``: those of
        the layer :meth:`_prepare` makes for it (a stand-in input, no values)."""
        dtype = np.uint8 if self.x_zero is None else self.x_zero.dtype
        x = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), tuple(x_shape), (0,) * 4)
        return "qconv2d", self._prepare(x, layout)[0].params.flops

    def function(self):
        """The NCHW run function, the NHWC one in ``fn.layouts`` (a QGemm's: one, of
        2-D operands)."""
        if self.matrix:
            fn = lambda a, *_, out=None: self.run_matrix(a, first(out))   # noqa: E731
            fn.describe = lambda layout, a_shape, *_: (
                "qgemm", self.describe("NHWC", (1, a_shape[0], 1, a_shape[1]))[1])
        else:
            # a fused sum's residual is input 9, after the conv's nine
            fn = in_layouts({layout: (lambda layout: lambda x, *rest, out=None: self.run(
                x, layout, first(out), rest[8] if self.sum else None))(layout)
                for layout in LAYOUTS})
            fn.describe = self.describe
        # the weights' int8 kernel, and amx where the convs may take its tiles: the
        # planner's timed costs are kept per kernel
        amx = runnable_int8_kinds()[0][0] == "amx"
        fn.kernel = "{} {}".format(*self.weights.kind) + (" amx" if amx else "")
        return writes_into(fn)


@operator("QLinearConv", CONV_ATTRS)
def _qlinear_conv(node, const):
    return QConvStep(node, const).function()


@operator("QGemm", ("alpha", "transA", "transB"))
def _qgemm(node, const):
    """com.microsoft's QGemm (and what :func:`tilegemm.net.passes.fuse_qdq` makes of
    a QDQ Gemm, its bias then float32 in real units)."""
    return QConvStep(node, const, matrix=True).function()


def _matrix_as_kernel(node, b):
    """A QGemm's constant B (k x n, or n x k with ``transB``) as the weights of a
    1x1 convolution (n, k, 1, 1)."""
    attrs = node.attrs
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
        raise unsupported(node, "only transA=0 and alpha=1 are supported")
    if b.ndim != 2:
        raise unsupported(node, f"a 2-D B expected, got {b.ndim}-D")
    return np.ascontiguousarray(b if attrs.get("transB", 0) else b.T)[:, :, None, None]


@operator("ConvInteger", CONV_ATTRS)
def _conv_integer(node, const):
    return QConvStep(node, const, integer=True).function()


# --------------------------------------------------------------------------- products
def _zero_value(node, zero, what):
    """A product operand's zero point as an int: one value (per-row or per-column
    zero points that differ are not supported)."""
    if zero is None:
        return 0
    flat = np.ravel(zero)
    if flat.size and np.any(flat != flat[0]):
        raise unsupported(node, f"per-row/column zero points of {what} (one value expected)")
    return int(flat[0]) if flat.size else 0


def _check_codes(node, *xs):
    for x in xs:
        if x.dtype not in RANGES:
            raise TypeError(f"node {node.name!r} ({node.op}): int8 or uint8 operands expected, "
                            f"got {x.dtype}")


@operator("MatMulInteger")
def _matmul_integer(node, const):
    def run(a, b, a_zero_point=None, b_zero_point=None):
        _check_codes(node, a, b)
        try:
            return (qmatmul(a, b, a_zero_point=_zero_value(node, a_zero_point, "A"),
                            b_zero_point=_zero_value(node, b_zero_point, "B")),)
        except (TypeError, ValueError) as err:
            raise type(err)(f"node {node.name!r} (MatMulInteger): {err}") from err
    return run


@operator("QLinearMatMul")
def _qlinear_matmul(node, const):
    """The exact int32 product, then ``y = sums * a_scale * b_scale`` requantized to
    ``y_scale`` / ``y_zero_point`` (b's scale may be per column)."""
    if np.size(const(node.inputs[1])) > 1:
        raise unsupported(node, "a scale per row of a (one value expected)")

    def run(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero):
        _check_codes(node, a, b)
        if np.size(a_scale) != 1:
            raise unsupported(node, "a scale per row of a (one value expected)")
        try:
            sums = qmatmul(a, b, a_zero_point=_zero_value(node, a_zero, "a"),
                           b_zero_point=_zero_value(node, b_zero, "b"))
        except (TypeError, ValueError) as err:
            raise type(err)(f"node {node.name!r} (QLinearMatMul): {err}") from err
        real = sums * (np.float64(np.ravel(a_scale)[0]) * np.ravel(b_scale).astype(np.float64))
        return (quantize_linear(real.astype(np.float32), y_scale, y_zero),)
    return run
