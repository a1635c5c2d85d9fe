"""The compute layers of a network: Conv (on :func:`tilegemm.conv.conv2d`, weights
prepared once), BatchNormalization, pooling, Gemm and MatMul (on the GEMM engine).

Inputs are NCHW (ONNX's layout).  What the passes fused into a Conv or Gemm node
(:attr:`~tilegemm.net.graph.Node.epilogue`) runs in its epilogue: the activation
(relu, relu6), and for a Conv the residual sum.
"""

import numpy as np

from tilegemm.conv import ConvWeights, PreparedConv, conv2d, conv_plan
from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_RELU, EPI_RELU6
from tilegemm.kernels.pool import for_slices
from tilegemm.kernels.driver import gemm_into
from tilegemm.net import pooling, reorder
from tilegemm.net.ops import clip, first, relu, writes_into
from tilegemm.net.registry import operator, unsupported

#: The layouts a 4-D activation can be stored in, as the order of the logical NCHW
#: axes in memory; a conversion is one transpose (:func:`convert`).
LAYOUTS = {"NCHW": (0, 1, 2, 3), "NHWC": (0, 2, 3, 1)}
#: Where the spatial axes (H, W) are in each layout.
SPATIAL = {"NCHW": (2, 3), "NHWC": (1, 2)}


def along(x, layout, logical, part):
    """The ``part`` slice of ``x`` (stored in ``layout``) along logical axis ``logical``
    (0: N, 1: C)."""
    at = [slice(None)] * x.ndim
    at[LAYOUTS[layout].index(logical)] = part
    return x[tuple(at)]


def _few_channels(x, src, out, channels):
    """:func:`convert` of a C-contiguous ``x`` with few ``channels`` into ``out``
    (:mod:`tilegemm.net.reorder`), the threads taking images."""
    copy = reorder.planes_to_pixels if src == "NCHW" else reorder.pixels_to_planes
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    n, hw = x.shape[0], x.size // max(1, x.shape[0] * channels)
    for_slices(lambda part: copy(flat_x, flat_out, part.start, part.stop, channels, hw),
               n, x.size)
    return out


def split_axis(shape, layout):
    """The logical axis a pass over a 4-D tensor (``shape`` in ``layout``) is split
    along between threads: the batch when there are several images, else the channels."""
    return 0 if shape[LAYOUTS[layout].index(0)] >= 2 else 1


def converted_shape(shape, src, dst):
    """The shape of a tensor of ``shape`` in layout ``src`` once in layout ``dst``."""
    return tuple(shape[a] for a in np.argsort(LAYOUTS[src])[list(LAYOUTS[dst])])


def convert(x, src, dst, out=None):
    """``x`` stored in layout ``src``, as a C-contiguous array in layout ``dst`` (into
    ``out`` if given; one transpose, the threads copying slices of the batch or the
    channels)."""
    if src == dst:
        return x
    to_logical = np.argsort(LAYOUTS[src])
    perm = to_logical[list(LAYOUTS[dst])]
    if out is None:
        out = np.empty(converted_shape(x.shape, src, dst), x.dtype)
    moved = [a for a in perm if x.shape[a] > 1]
    if moved == sorted(moved) and x.flags.c_contiguous and out.flags.c_contiguous:
        # the axes that move have length 1 (a pooled 1 x 1 image, a single channel):
        # the same values in the same order, one copy
        np.copyto(out, x.reshape(out.shape))
        return out
    channels = x.shape[LAYOUTS[src].index(1)]
    if channels <= reorder.MAX_CHANNELS and x.flags.c_contiguous and out.flags.c_contiguous:
        return _few_channels(x, src, out, channels)
    axis = split_axis(x.shape, src)
    length = x.shape[LAYOUTS[src].index(axis)]

    def copy(part):
        np.copyto(along(out, dst, axis, part), along(x, src, axis, part).transpose(perm))
    for_slices(copy, length, x.size)
    return out


def in_layouts(per_layout):
    """The NCHW function of ``per_layout`` ({layout: fn}), carrying the others as
    ``fn.layouts`` for the layout plan."""
    fn = per_layout["NCHW"]
    fn.layouts = per_layout
    return fn


#: Epilogue activations and what a residual sum falls back to when it broadcasts.
ACTIVATIONS = {None: lambda y: y, "relu": relu,
               "relu6": lambda y: clip(y, np.float64(0), np.float64(6))}
_GEMM_FLAGS = {None: 0, "relu": EPI_RELU, "relu6": EPI_RELU6}


def _pair(node, key, default):
    value = node.attrs.get(key, default)
    if len(value) != 2:
        raise unsupported(node, f"{key}={value}: only 2-D (NCHW) operators are supported")
    return tuple(int(v) for v in value)


def window(node, kernel):
    """``(strides, dilations, pads(H, W) -> (top, left, bottom, right))`` of a Conv or
    pooling node; ``auto_pad`` SAME_* pads depend on the input size."""
    strides, dilations = _pair(node, "strides", (1, 1)), _pair(node, "dilations", (1, 1))
    auto = node.attrs.get("auto_pad", "NOTSET")
    if auto not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise unsupported(node, f"auto_pad={auto!r}")
    explicit = tuple(int(p) for p in node.attrs.get("pads", (0, 0, 0, 0)))
    if len(explicit) != 4 or min(explicit) < 0:
        raise unsupported(node, f"pads={list(explicit)}: four non-negative 2-D pads expected")

    def pads(H, W):
        if auto == "NOTSET":
            return explicit
        if auto == "VALID":
            return (0, 0, 0, 0)
        begin, end = [], []
        for size, k, s, d in zip((H, W), kernel, strides, dilations):
            total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small = total // 2
            begin.append(small if auto == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        return (begin[0], begin[1], end[0], end[1])
    return strides, dilations, pads


def _four_d(node, x, what="input"):
    if x.ndim != 4:
        raise ValueError(f"node {node.name!r} ({node.op}): {what} must be 4-D NCHW, "
                         f"got shape {x.shape}")


# --------------------------------------------------------------------------- Conv
@operator("Conv", ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _conv(node, const):
    w = const(node.inputs[1])
    if w is None or w.ndim != 4:
        raise unsupported(node, "the weights must be a constant 4-D tensor (2-D convolution)")
    b = const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if len(node.inputs) > 2 and node.inputs[2] and b is None:
        raise unsupported(node, "the bias must be a constant")
    kernel = w.shape[2:]
    if tuple(node.attrs.get("kernel_shape", kernel)) != kernel:
        raise ValueError(f"node {node.name!r} (Conv): kernel_shape "
                         f"{node.attrs['kernel_shape']} differs from the weights' {kernel}")
    return ConvStep(node, w, b, kernel).function()


#: Algorithms the layout plan times for a conv: those whose estimate is within this
#: factor of the best estimate (a conv's fastest is then a measurement, not a model's).
COMPETITIVE = 3.0
#: What ``auto`` runs: conv2d's cost model picks.
AUTO = ("auto", None)


class ConvStep:
    """A network's Conv: weights prepared once, a :class:`PreparedConv` per input shape,
    layout and algorithm, and the functions a plan runs (:meth:`function`)."""

    def __init__(self, node, w, b, kernel):
        self.node, self.w, self.b = node, w, b
        self.strides, self.dilations, self.pads = window(node, kernel)
        self.groups = int(node.attrs.get("group", 1))
        self.weights = ConvWeights(w)
        self.act = node.epilogue.get("activation")
        self.prepared = {}     # (shape, dtype, layout, choice) -> PreparedConv
        self.variants = {}     # (layout, choice) -> run function
        self.calls = {}        # (input shape, dtype, layout, choice) -> (conv, copies, padding)

    def padded(self, x, layout="NCHW"):
        """``(x, padding)`` for conv2d, which pads alike on both sides: uneven pads
        (SAME_* with a stride, explicit) are made on a copy of ``x``."""
        ay, ax = SPATIAL[layout]
        top, left, bottom, right = self.pads(x.shape[ay], x.shape[ax])
        if (top, left) == (bottom, right):
            return x, (top, left)
        width = [(0, 0)] * 4
        width[ay], width[ax] = (top, bottom), (left, right)
        return np.pad(x, width), 0

    def conv(self, x, padding, layout, choice):
        """The :class:`PreparedConv` for padded ``x`` in ``layout`` with ``choice``
        ((algorithm, Winograd tile))."""
        key = (x.shape, x.dtype, layout, choice)
        if key not in self.prepared:
            self.prepared[key] = PreparedConv(
                x.shape, self.weights, self.b, self.strides, padding, self.dilations,
                self.groups, activation=self.act, layout=layout, dtype=x.dtype,
                algorithm=choice[0], winograd_tile=choice[1])
        return self.prepared[key]

    def run(self, x, residual, layout, out, residual_free, choice):
        key = (x.shape, x.dtype, layout, choice)
        call = self.calls.get(key)
        if call is None:                      # checked and planned once per input shape
            _four_d(self.node, x)
            padded, padding = self.padded(x, layout)
            call = self.calls[key] = (self.conv(padded, padding, layout, choice),
                                      padded is not x, padding)
        conv, copies, padding = call
        if copies:                            # uneven pads: a padded copy
            x, _ = self.padded(x, layout)
        try:
            if residual is None:
                return (conv(x, out=first(out)),)
            if residual.shape != conv.output_shape:    # a broadcast sum: after the conv
                return (ACTIVATIONS[self.act](conv2d(
                    x, self.weights, self.b, self.strides, padding, self.dilations, self.groups,
                    layout=layout, algorithm=choice[0], winograd_tile=choice[1]) + residual),)
            if _sums_into(conv, residual, residual_free):
                out = [residual]      # summed in the epilogue, in the residual's buffer
            return (conv(x, residual, out=first(out)),)
        except (ValueError, TypeError) as err:
            raise type(err)(f"node {self.node.name!r} (Conv): {err}") from err

    def replay_form(self, x, residual, layout, out, residual_free, choice):
        """What a replayed run calls instead, after :meth:`run` accepted these
        arguments: the conv's path bound to the same output buffer (the checks and
        decisions of ``run`` and of the conv made once), or None."""
        call = self.calls.get((x.shape, x.dtype, layout, choice))
        if call is None or call[1] or out is None:
            return None
        conv = call[0]
        if residual is None:
            fast = conv.runner_for(out[0])
        elif residual.shape == conv.output_shape and _sums_into(conv, residual, residual_free):
            fast = conv.runner_for(residual, residual)
        else:
            return None
        return None if fast is None else (lambda x, *_, **__: (fast(x),))

    def variant(self, layout, choice=AUTO):
        """The step's function for ``layout`` and ``choice``, made once."""
        key = (layout, choice)
        if key not in self.variants:
            def fn(x, _w, _b=None, residual=None, out=None, residual_free=False):
                return self.run(x, residual, layout, out, residual_free, choice)
            # residual_free=True: no later step reads the residual, its buffer may take
            # the result (where the path sums in its epilogue, PreparedConv.accumulates)
            fn.sums_in_place = bool(self.node.epilogue.get("residual"))
            fn.writes_into = True
            fn.replay_form = lambda x, _w, _b=None, residual=None, out=None, \
                residual_free=False: self.replay_form(x, residual, layout, out, residual_free,
                                                      choice)
            self.variants[key] = fn
        return self.variants[key]

    def choices(self, layout, x_shape, dtype):
        """The (algorithm, Winograd tile) worth timing for an input of ``x_shape``:
        those :func:`tilegemm.conv_plan` estimates within :data:`COMPETITIVE` of its best."""
        x = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), x_shape, (0,) * 4)
        x, padding = self.padded(x, layout)
        plan = conv_plan(x.shape, self.w.shape, self.strides, padding, self.dilations,
                         self.groups, layout=layout, dtype=dtype)
        estimates = {(a, None): t for a, t in plan.estimates.items() if a != "winograd"}
        estimates.update({("winograd", m): t for m, t in plan.winograd_estimates.items()})
        best = min(estimates.values())
        return [c for c, t in sorted(estimates.items(), key=lambda kv: kv[1])
                if t <= COMPETITIVE * best]

    def describe(self, layout, x_shape, *_, choice=AUTO):
        """(the conv path, flops) for an input of ``x_shape`` in ``layout``."""
        x = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), x_shape, (0,) * 4)
        x, padding = self.padded(x, layout)
        conv = self.conv(x, padding, layout, choice)
        return conv.path, conv.params.flops

    def function(self):
        """The NCHW auto function, with the others reachable: ``fn.layouts``,
        ``fn.variant(layout, choice)``, ``fn.choices(...)``, ``fn.describe(...)``."""
        fn = in_layouts({layout: self.variant(layout) for layout in LAYOUTS})
        fn.variant, fn.choices, fn.describe = self.variant, self.choices, self.describe
        return writes_into(fn)


def _sums_into(conv, residual, residual_free):
    """Whether ``conv`` sums ``residual`` in its epilogue straight into the residual's
    own buffer (free: no later step reads it)."""
    return (residual_free and conv.accumulates and residual.dtype == conv.dtype
            and residual.flags.c_contiguous and residual.flags.writeable)


# --------------------------------------------------------------------------- BatchNormalization
@operator("BatchNormalization", ("epsilon", "momentum", "training_mode"))
def _batchnorm(node, const):
    """Inference BatchNormalization not folded into a conv: a per-channel affine map."""
    if node.attrs.get("training_mode", 0):
        raise unsupported(node, "training_mode=1 (only inference runs)")
    params = [const(name) for name in node.inputs[1:5]]
    if any(p is None for p in params):
        raise unsupported(node, "scale, bias, mean and variance must be constants")
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    scale = gamma / np.sqrt(var + node.attrs.get("epsilon", 1e-5))
    shift = beta - mean * scale

    def batchnorm(x, *_):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        return (x * scale.astype(x.dtype).reshape(shape) + shift.astype(x.dtype).reshape(shape),)
    return batchnorm


# --------------------------------------------------------------------------- pooling
def _pool_size(size, begin, end, k, s, d, ceil_mode):
    span = (k - 1) * d + 1
    total = size + begin + end
    if total < span:
        raise ValueError(f"a pooling window of {span} does not fit {size} (+ pads {begin}, {end})")
    out = (-(-(total - span) // s) if ceil_mode else (total - span) // s) + 1
    if ceil_mode and (out - 1) * s >= size + begin:    # the last window must start inside
        out -= 1
    return out


def pool2d(x, kernel, strides, dilations, pads, ceil_mode, kind, count_pads=False,
           layout="NCHW", out=None):
    """Max or average pooling of ``x`` (4-D in ``layout``) into ``out`` (new if None);
    ``pads`` (top, left, bottom, right).  The kernels of :mod:`tilegemm.net.pooling`,
    the threads taking slices of the batch or, for one image, of the output rows
    (NHWC: each keeps whole pixels, one run of a row) or of the channels (NCHW)."""
    ay, ax = SPATIAL[layout]
    shape = list(x.shape)
    shape[ay], shape[ax] = (_pool_size(x.shape[a], pads[i], pads[i + 2], kernel[i], strides[i],
                                       dilations[i], ceil_mode) for i, a in enumerate((ay, ax)))
    if out is not None and not out.flags.c_contiguous:     # the kernels write flat arrays
        np.copyto(out, pool2d(x, kernel, strides, dilations, pads, ceil_mode, kind,
                              count_pads, layout))
        return out
    out = np.empty(shape, x.dtype) if out is None else out
    if out.size == 0:
        return out
    x = np.ascontiguousarray(x)
    geom = (kernel[0], kernel[1], strides[0], strides[1], dilations[0], dilations[1]) + tuple(pads)
    run = pooling.pool_nhwc if layout == "NHWC" else pooling.pool_nchw
    dims = x.shape + (out.shape[ay], out.shape[ax])
    N, C = x.shape[0], x.shape[LAYOUTS[layout].index(1)]       # logical axis 1: C
    xf, of = x.reshape(-1), out.reshape(-1)

    Ho = out.shape[ay]
    rows = N == 1 and layout == "NHWC"

    def part(s):                       # images s, or output rows or channels s of one image
        if N > 1:
            bounds = (s.start, s.stop, 0, C, 0, Ho)
        else:
            bounds = (0, 1, 0, C, s.start, s.stop) if rows else (0, 1, s.start, s.stop, 0, Ho)
        # NHWC: rows of W pixels' channels; NCHW: rows of W values
        width = x.shape[ax] * (C if layout == "NHWC" else 1)
        bufs = np.empty((3, width), x.dtype)
        taps = np.empty(max(kernel[0], kernel[1], kernel[0] + 3 * out.shape[ax]), np.intp)
        run(xf, of, dims, geom, kind == "max", count_pads, bounds, bufs, taps)
    for_slices(part, N if N > 1 else (Ho if rows else C), x.size)
    return out


def _pool(kind):
    def build(node, const):
        kernel = _pair(node, "kernel_shape", ())
        if node.attrs.get("storage_order", 0):
            raise unsupported(node, "storage_order=1")
        if len(node.outputs) > 1 and node.outputs[1]:
            raise unsupported(node, "the Indices output")
        strides, dilations, pads = window(node, kernel)
        ceil_mode = bool(node.attrs.get("ceil_mode", 0))
        count_pads = bool(node.attrs.get("count_include_pad", 0))

        def pool_in(layout):
            ay, ax = SPATIAL[layout]

            def pool(x, out=None):
                _four_d(node, x)
                return (pool2d(x, kernel, strides, dilations, pads(x.shape[ay], x.shape[ax]),
                               ceil_mode, kind, count_pads, layout, first(out)),)
            return pool
        return writes_into(in_layouts({layout: pool_in(layout) for layout in LAYOUTS}))
    return build


_WINDOW = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")
operator("MaxPool", _WINDOW + ("storage_order",))(_pool("max"))
operator("AveragePool", _WINDOW + ("count_include_pad",))(_pool("average"))


def _global(reduce):
    def build(node, const):
        def nchw(x, out=None):
            return (reduce(x, axis=tuple(range(2, x.ndim)), keepdims=True, out=first(out)),)

        def nhwc(x, out=None):
            return (reduce(x, axis=SPATIAL["NHWC"], keepdims=True, out=first(out)),)
        return writes_into(in_layouts({"NCHW": nchw, "NHWC": nhwc}))
    return build


operator("GlobalAveragePool")(_global(np.mean))
operator("GlobalMaxPool")(_global(np.max))


# --------------------------------------------------------------------------- products
def product(a, b, alpha=1.0, bias=None, act=None, out=None):
    """``act(alpha * a @ b + bias)`` of 2-D float arrays on the GEMM engine (``bias``
    a row added to every row), into ``out`` if given."""
    dtype = np.result_type(a, b, np.float32)
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), dtype)
    epi = _GEMM_FLAGS[act]
    if bias is not None:
        bias, epi = np.ascontiguousarray(bias, dtype).reshape(-1), epi | EPI_BIAS_COL
    return gemm_into(a, b, out, alpha, 0.0, bias, epi)


def _check_product(node, a, b):
    if a.dtype.kind != "f" or b.dtype.kind != "f":
        raise TypeError(f"node {node.name!r} ({node.op}): float operands expected, got "
                        f"{a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise ValueError(f"node {node.name!r} ({node.op}): shapes {a.shape} and {b.shape} do "
                         "not chain")


@operator("Gemm", ("alpha", "beta", "transA", "transB"))
def _gemm(node, const):
    alpha, beta = node.attrs.get("alpha", 1.0), node.attrs.get("beta", 1.0)
    trans_a, trans_b = node.attrs.get("transA", 0), node.attrs.get("transB", 0)
    act = node.epilogue.get("activation")

    def gemm(a, b, c=None, out=None):
        a, b = (a.T if trans_a else a), (b.T if trans_b else b)
        if a.ndim != 2 or b.ndim != 2:
            raise ValueError(f"node {node.name!r} (Gemm): 2-D operands expected")
        _check_product(node, a, b)
        if c is None or beta == 0:
            return (product(a, b, alpha, act=act, out=first(out)),)
        if c.size == b.shape[1] and c.ndim <= 2 and c.shape[-1] == b.shape[1]:
            # a row: the epilogue's bias
            return (product(a, b, alpha, beta * c, act, first(out)),)
        y = product(a, b, alpha) + beta * c
        return (ACTIVATIONS[act](y),)
    gemm.describe = lambda layout, a, b, *_: ("gemm",
                                              2 * a[1 - trans_a] * a[trans_a] * b[1 - trans_b])
    return writes_into(gemm)


@operator("MatMul")
def _matmul(node, const):
    def matmul(a, b):
        _check_product(node, a, b)
        if a.ndim == 2 and b.ndim == 2:
            return (product(a, b),)
        if b.ndim == 2 and a.ndim > 2:                 # rows of every matrix at once
            return (product(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + b.shape[1:]),)
        a2, b2 = (a[None] if a.ndim == 1 else a), (b[:, None] if b.ndim == 1 else b)
        batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        a2 = np.broadcast_to(a2, batch + a2.shape[-2:])
        b2 = np.broadcast_to(b2, batch + b2.shape[-2:])
        out = np.stack([product(x, y) for x, y in zip(a2.reshape((-1,) + a2.shape[-2:]),
                                                      b2.reshape((-1,) + b2.shape[-2:]))])
        out = out.reshape(batch + out.shape[-2:])
        if a.ndim == 1:
            out = out[..., 0, :]
        if b.ndim == 1:
            out = out[..., 0]
        return (out,)
    matmul.describe = lambda layout, a, b: ("gemm",
                                            2 * int(np.prod(a)) * (b[-1] if len(b) > 1 else 1))
    return matmul
