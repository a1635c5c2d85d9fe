"""The quantized convolution's public face: :func:`qconv2d` and :class:`QConvWeights`.

int8 weights per output channel, an int8 or uint8 input with a zero point, int32
sums on the exact int8 GEMM and one fused epilogue (``conv/quantized.py``).
"""
import threading
from typing import NamedTuple

import numpy as np

from tilegemm.conv.params import ACTIVATIONS, conv_params
from tilegemm.conv.quantized import ACTIVATIONS as ACTIVATION_CODES
from tilegemm.conv.quantized import TapsPanels, TapsPlan, qconv2d_into, qdepthwise_into
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.validate import check_choice, float_array, real_scalar
from tilegemm.ground.contracts import round_up
from tilegemm.ground.workspace import buffers
from tilegemm.kernels.int8 import GROUP
from tilegemm.kernels.pool import run_shares
from tilegemm.kernels.transpose import BLOCK, transpose_bytes, transpose_rows
from tilegemm.kernels.qgemm import int8_kind_for, pack_b_once, taps_kind_for, taps_serve
from tilegemm.kernels.requant import NOT_FOLDED, add_codes, fold
from tilegemm.conv.quant import INT8_DTYPES, RANGES, check_bound, int8_array, zero_point


def _positive(value, name, func):
    value = real_scalar(value, name, func)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{func}: {name} must be positive and finite, got {value}")
    return value


def _channel_scales(w_scale, K, func):
    """``w_scale`` as K float64 values: one per output channel, or one for all."""
    scales = np.asarray(w_scale, np.float64) if not np.isscalar(w_scale) else None
    if scales is None or scales.ndim == 0:
        return np.full(K, _positive(w_scale if scales is None else float(scales), "w_scale",
                                    func))
    if scales.shape != (K,):
        raise ValueError(f"{func}: w_scale must be a scalar or have shape ({K},) (one per "
                         f"output channel), got {scales.shape}")
    if not (np.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError(f"{func}: w_scale must be positive and finite")
    return scales


class QConvWeights:
    """int8 convolution weights prepared once for many :func:`qconv2d` calls.

    Holds a read-only copy of the weights and their per-channel scales, the
    matrices the quantized GEMM multiplies (per group ``kh*kw*Cg x Kg``) and their
    int8 micro-kernel panels, made on first use: a call packs no weights.

    Parameters
    ----------
    weight : array_like of int8, shape (K, C/groups, kh, kw)
    w_scale : float or array_like of float, shape (K,)
        Positive; one scale per output channel or one for all.
    """

    def __init__(self, weight, w_scale):
        func = "QConvWeights"
        w = int8_array(weight, "weight", func)
        if w.dtype != np.int8 or w.ndim != 4:
            raise TypeError(f"{func}: weight must be a 4-D int8 array (K, C/groups, kh, kw), got "
                            f"{w.ndim}-D {w.dtype} (quantize weights with tilegemm.quantize)")
        self.weight = np.array(w, order="C")
        self.weight.flags.writeable = False
        self.scales = _channel_scales(w_scale, w.shape[0], func)
        self._matrices = {}
        self._panels = {}
        self._taps = {}
        self._kind = None
        self._calls = {}             # qconv2d's PreparedQConv per call key, least recent first
        self._last = None            # (key, PreparedQConv) of the latest call
        self._lock = threading.Lock()

    @property
    def kind(self):
        """The ``(kind, bits)`` of the int8 kernel for these weights
        (``kernels.qgemm.int8_kind_for``: 7-bit weights get ``maddubs`` on AVX2)."""
        if self._kind is None:
            self._kind = int8_kind_for(self.weight)
        return self._kind

    @property
    def shape(self):
        return self.weight.shape

    def matrices(self, groups, multiple=1, kw=None):
        """Per group, the ``kh*kw*Cg x Kg`` int8 matrix the quantized GEMM takes, rows
        in (r, s, c) order as the channels-last patches hold them (cached).  Zero
        channels round ``Cg`` up to a ``multiple`` (the taps kernel's words of
        channels), zero taps the kernel's width up to ``kw`` (an amx taps tile's runs)."""
        K, Cg, kh, kw0 = self.weight.shape
        kw = kw or kw0
        key = (groups, multiple, kw)
        if key not in self._matrices:
            Kg = K // groups
            w = np.zeros((K, round_up(Cg, multiple), kh, kw), np.int8)
            w[:, :Cg, :, :kw0] = self.weight
            self._matrices[key] = [
                np.ascontiguousarray(w[g * Kg:(g + 1) * Kg].transpose(2, 3, 1, 0)
                                     .reshape(-1, Kg)) for g in range(groups)]
        return self._matrices[key]

    def panels(self, groups, multiple=1, kind=None, kw=None):
        """Per group, :meth:`matrices` packed for ``kind``'s kernel (default
        :attr:`kind`; cached); ``amx``'s with all of k in one block."""
        key = (groups, multiple, kind or self.kind, kw or self.shape[3])
        if key not in self._panels:
            self._panels[key] = [pack_b_once(w, 0, key[2], whole_k=key[2][0] == "amx")
                                 for w in self.matrices(groups, multiple, key[3])]
        return self._panels[key]

    def taps(self, groups, shape=None):
        """:meth:`panels` for the taps kernel, every group's in one :class:`TapsPanels`
        (cached): ``shape = (kind, multiple, kw)`` as
        :func:`~tilegemm.kernels.qgemm.taps_kind_for` gives it, default :attr:`kind`'s
        with channels in whole words."""
        shape = shape or (self.kind, GROUP[self.kind[0]], self.shape[3])
        key = (groups,) + tuple(shape)
        if key not in self._taps:
            kind, multiple, kw = shape
            self._taps[key] = TapsPanels(self.panels(groups, multiple, kind, kw), multiple, kw)
        return self._taps[key]

    def depthwise(self):
        """A depthwise layer's weights as int32 ``(kh*kw, K)``, each tap's channels a
        row, as ``kernels/qdepthwise.py`` reads them (not kept: the prepared call
        keeps them)."""
        K, _, kh, kw = self.weight.shape
        return np.ascontiguousarray(self.weight.reshape(K, kh * kw).T, dtype=np.int32)

    def prepared(self, key, make):
        """The :class:`PreparedQConv` :func:`qconv2d` keeps for the call ``key``, made by
        ``make()`` on first use; the :data:`KEPT_CALLS` most recently used are kept."""
        last = self._last               # one read: another thread may replace it
        if last is not None and last[0] == key:     # a layer called again and again
            return last[1]
        with self._lock:
            call = self._calls.pop(key, None)
            if call is not None:            # the most recently used last
                self._calls[key] = call
                self._last = (key, call)
        if call is None:
            call = make()
            with self._lock:
                self._calls[key] = call
                self._last = (key, call)
                while len(self._calls) > KEPT_CALLS:
                    del self._calls[next(iter(self._calls))]
        return call

    def __repr__(self):
        return f"QConvWeights(shape={self.shape})"


#: The prepared calls a :class:`QConvWeights` keeps for :func:`qconv2d` (a network
#: calls one layer with a few input shapes).
KEPT_CALLS = 16


def _call_key(x, values):
    """A hashable key of everything a :func:`qconv2d` call's :class:`PreparedQConv`
    depends on: ``x``'s shape and dtype and ``values`` (with their types: an int8 zero
    point and an int one give different outputs), or None when one is not a plain
    value (an array-like object may change its values without changing its
    identity)."""
    parts = [x.shape, x.dtype.str]
    for value in values:
        kind = type(value)
        if kind in _SCALARS:       # the common cases, with no isinstance chain
            parts.append((kind, value))
            continue
        if kind is np.ndarray and value.dtype.kind in "biuf":
            parts.append(("array", value.dtype.str, value.shape, value.tobytes()))
            continue
        part = _value_key(value)
        if part is None:
            return None
        parts.append(part)
    return tuple(parts)


#: Argument types whose values (and type) make a key.
_PLAIN = (int, float, bool, str, np.integer, np.floating, np.bool_)
#: Exact types taken as they are by :func:`_call_key` (through :func:`_value_key` a
#: call's key took 8 us on average between calls of a 1x1 layer of 25 us; 5 us now).
_SCALARS = frozenset((int, float, bool, str, type(None), np.float32, np.float64, np.int8,
                      np.uint8, np.int32, np.int64))


def _value_key(value):
    """``value`` as a hashable key equal only for equal values of one type, or None."""
    if value is None:
        return ("none",)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            return None
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        parts = tuple(_value_key(v) for v in value)
        return None if None in parts else (type(value).__name__,) + parts
    if isinstance(value, _PLAIN):
        return (type(value), value)
    return None


def qconv2d(x, x_scale, w, w_scale=None, bias=None, *, x_zero_point=0, stride=1, padding=0,
            dilation=1, groups=1, activation=None, out_scale=None, out_zero_point=0,
            layout="NCHW"):
    """Quantized 2-D convolution: int8 weights, exact int32 sums, one fused epilogue.

    Computes ``y = conv2d(x - x_zero_point, w) * x_scale * w_scale[k] + bias[k]``,
    then ``activation``, with the sums exact in int32; returns y as float32, or with
    ``out_scale`` the code ``clip(round(y / out_scale) + out_zero_point)`` (round half
    to even, saturating) as ONNX's QLinearConv does.  Geometry as
    :func:`tilegemm.conv2d` (torch semantics).

    Parameters
    ----------
    x : array_like of int8 or uint8
        ``(N, C, H, W)``, or ``(N, H, W, C)`` with ``layout="NHWC"``.
    x_scale : float
        Positive.
    w : array_like of int8, shape (K, C/groups, kh, kw), or QConvWeights
        Symmetric (no zero point).  :class:`QConvWeights` for weights used many times
        (``w_scale`` is then its own).
    w_scale : float or array_like of float, shape (K,)
        Positive; per output channel or one for all.  None with :class:`QConvWeights`
        (a TypeError otherwise: they carry their own).
    bias : array_like of float, shape (K,), optional
        In the output's real units (added after scaling).
    x_zero_point : int
        In ``x``'s dtype range; the padding holds it (it adds nothing).
    stride, padding, dilation, groups
        As :func:`tilegemm.conv2d`.
    activation : None, "relu" or "relu6"
    out_scale : float, optional
        Requantize with this scale; None returns float32.
    out_zero_point : int, numpy.int8 or numpy.uint8
        In the output dtype's range.  As ONNX's ``y_zero_point``, its type gives the
        requantized output's dtype: a numpy int8 or uint8 scalar makes that dtype,
        a Python int keeps ``x``'s.
    layout : "NCHW" or "NHWC"

    Returns
    -------
    ndarray
        ``(N, K, Ho, Wo)`` or ``(N, Ho, Wo, K)``: float32, or int8/uint8 when
        requantized.

    Raises
    ------
    TypeError
        Inputs of other dtypes (float input, non-int8 weights), non-integer zero points
        or geometry.
    ValueError
        Shapes, geometry or groups that do not fit, scales that are not positive and
        finite, a scale array of the wrong length, zero points out of range, unknown
        activation or layout, a non-finite bias when requantizing, or a kernel so
        large (C/groups x kh x kw) that the int32 sums could overflow.
    """
    if not isinstance(w, QConvWeights) and w_scale is None:
        raise TypeError("qconv2d: w_scale is required with plain weights")
    if isinstance(w, QConvWeights) and w_scale is not None:
        raise TypeError("qconv2d: QConvWeights carry their own scales: pass w_scale=None "
                        "(a bias given in its place?)")
    x = int8_array(x, "x", "qconv2d")
    # in QCONV_OPTIONS' order
    options = (x_zero_point, stride, padding, dilation, groups, activation, out_scale,
               out_zero_point, layout)

    def make():
        return PreparedQConv(x.shape, x.dtype, x_scale, weights, bias,
                             **dict(zip(QCONV_OPTIONS, options)))

    if not isinstance(w, QConvWeights):
        weights = QConvWeights(w, w_scale)
        return make()(x)
    # Checking and planning a call costs ~0.15 ms, a tenth of a ResNet-18 layer: the
    # weights keep the prepared call of each recent set of arguments.
    weights = w
    key = _call_key(x, (x_scale, bias) + options)
    return (make() if key is None else weights.prepared(key, make))(x)


class PreparedQConv:
    """One :func:`qconv2d` layer checked and planned once for inputs of one shape and
    dtype; calling it runs the convolution (into ``out`` when given).

    Parameters
    ----------
    x_shape : tuple of int
    x_dtype : numpy.int8 or numpy.uint8
    x_scale : float
    weights : QConvWeights
    bias : array_like of float, shape (K,), optional
    **options
        :func:`qconv2d`'s keyword arguments (``x_zero_point``, ``stride``,
        ``padding``, ``dilation``, ``groups``, ``activation``, ``out_scale``,
        ``out_zero_point``, ``layout``).
    residual : QuantizedSum, optional
        A QDQ model's residual sum after the conv: calls then take the residual's
        codes and give ``Q(act(DQ(conv codes) + DQ(residual)))``, the codes of
        ``out_scale`` summed while in cache (NHWC on the taps kernel), bit for bit
        as the three steps (:func:`tilegemm.kernels.requant.add_codes`).

    Raises
    ------
    TypeError, ValueError
        As :func:`qconv2d`.
    """

    def __init__(self, x_shape, x_dtype, x_scale, weights, bias=None, *, residual=None,
                 **options):
        func = "qconv2d"
        unknown = sorted(set(options) - set(QCONV_OPTIONS))
        if unknown:
            raise TypeError(f"{func}: unexpected options {unknown}")
        opt = dict(QCONV_OPTIONS, **options)
        check_choice(opt["activation"], ACTIVATIONS, "activation", func)
        p = conv_params(tuple(x_shape), weights.shape, opt["stride"], opt["padding"],
                        opt["dilation"], opt["groups"], opt["layout"], func)
        self.x_dtype = np.dtype(x_dtype)
        self.zero = zero_point(opt["x_zero_point"], self.x_dtype, "x_zero_point", func)
        check_bound(p.Cg * p.kh * p.kw, self.x_dtype, self.zero, np.dtype(np.int8), 0, func)
        mult = _positive(x_scale, "x_scale", func) * weights.scales
        b = np.zeros(p.K) if bias is None else float_array(bias, "bias", func).astype(np.float64)
        if b.shape != (p.K,):
            raise ValueError(f"{func}: bias must have shape ({p.K},), got {b.shape}")
        self.out_dtype, requant = _output(opt["out_scale"], opt["out_zero_point"], self.x_dtype,
                                          b, func)
        self.params, self.weights, self.input_shape = p, weights, tuple(x_shape)
        self.output_shape = p.output_shape()
        act = ACTIVATION_CODES[opt["activation"]]
        # |sum| <= the products per sum x 255 x 128 (uint8 codes less their zero point
        # by int8 weights)
        folded = fold(mult, b, act, requant, p.Cg * p.kh * p.kw * 255 * 128)
        self.epilogue = (mult, b, act, requant, NOT_FOLDED if folded is None else folded)
        self._plans = {}
        self._depthwise = None
        # the taps kernel's int8 kernel and shape: amx tiles where they serve this layer
        self.taps_shape = taps_kind_for(weights.kind, p.Cg, p.groups, p.Kg,
                                        (p.kw, p.dx, p.left + p.W + p.right, p.Wo, p.sy, p.sx))
        self.codes_dtype, self.summed = self.out_dtype, None
        if residual is not None:
            if requant[0] == 0.0:
                raise ValueError(f"{func}: a residual sum needs the conv's codes: give out_scale")
            self.out_dtype, self.residual_dtype, self.summed = _summed(
                QuantizedSum(*residual), requant, self.out_dtype, func)
        # an NCHW layer of byte codes on the taps kernel: its NHWC twin between two
        # transposes (the tiles then write the codes; see :meth:`_twin_into`), made
        # on first use
        self._twin = None
        self._twin_args = None
        self._twin_step = 1       # the input rows the twin takes: every one, or every sy-th
        self._local = threading.local()       # the twin's buffers, per thread
        taps = taps_serve(weights.kind, p.Cg, p.groups)
        if (p.layout == "NCHW" and requant[0] > 0.0 and not p.Cg == p.Kg == 1
                and min(p.C, p.K) >= TWIN_MIN_CHANNELS and taps):
            self._twin_args = (x_scale, bias, dict(options, layout="NHWC"))
            # a strided 1x1 layer reads every sy-th row: only those are transposed,
            # the twin a layer of stride (1, sx) over them (half the bytes at stride 2)
            if (p.kh == p.kw == 1 and p.sy > 1 and min(p.C, p.W) >= BLOCK
                    and p.top == p.bottom == p.left == p.right == 0):
                self._twin_step = p.sy
                self._twin_args[2].update(stride=(1, p.sx), padding=0)
        # the path of every call (a call takes it without asking again)
        self._path = (_DEPTHWISE if p.Cg == p.Kg == 1 else
                      _TWIN if self._twin_args is not None and self.codes_dtype.itemsize == 1
                      else _TAPS if taps else _PATCHES)

    def __call__(self, x, out=None, residual=None):
        """The convolution of ``x`` (this shape and dtype, C-contiguous or copied), into
        ``out`` when it is a C-contiguous array of the output's shape and dtype; with a
        residual sum, summed with ``residual`` (the residual's codes, output-shaped)."""
        if x.shape != self.input_shape or x.dtype != self.x_dtype:
            raise ValueError(f"qconv2d: prepared for {self.x_dtype} inputs of shape "
                             f"{self.input_shape}, got {x.dtype} {x.shape}")
        if (residual is None) != (self.summed is None):
            raise TypeError("qconv2d: a residual is " + ("missing: prepared with a residual sum"
                            if residual is None else "given to a layer prepared without one"))
        if residual is not None:
            residual = self._checked_residual(residual)
        if not (out is not None and out.shape == self.output_shape and out.dtype == self.out_dtype
                and out.flags.c_contiguous and out.flags.writeable):
            out = np.empty(self.output_shape, self.out_dtype)
        if out.size == 0:
            return out
        if residual is not None:
            return self._summed_into(x, residual, out)
        return self._into(x, out)

    def _into(self, x, out):
        """The conv's own output (codes, or float32 / int32 values) of ``x`` into ``out``."""
        path, x = self._path, np.ascontiguousarray(x)
        if path == _TAPS:           # the taps kernel: no patches
            plan = self._plans.get(get_num_threads())
            return (plan or self._taps_plan())(x, out)
        if path == _TWIN:
            return self._twin_into(x, out)
        p = self.params
        if path == _DEPTHWISE:      # lanes over channels, no GEMM
            if self._depthwise is None:
                self._depthwise = self.weights.depthwise()
            return qdepthwise_into(x, self.zero, self._depthwise, self.epilogue, p, out)
        return qconv2d_into(x, self.zero, self.weights.matrices(p.groups), self.epilogue, p, out,
                            self.weights.panels(p.groups))

    def _twin_into(self, x, out):
        """The NCHW layer as its NHWC twin: ``x`` transposed to channels-last, the twin's
        codes (written by its tiles) transposed back into ``out``'s channel planes.
        Both transposes in 16 x 16 byte blocks (``kernels/transpose.py``); the taps
        kernel's own NCHW path transposes 8 x 8 blocks as it widens rows, and writes
        the planes from int32 sums: ResNet-18 conv2_x 288 -> 189 us, ResNet-50's
        256 -> 64 1x1 at 56 x 56 357 -> 305 us (one thread, AMX Xeon, a loop of calls)."""
        p, twin = self.params, self._twin
        if twin is None:      # two threads may both make it: either serves
            x_scale, bias, options = self._twin_args
            twin = self._twin = PreparedQConv((p.N, (p.H - 1) // self._twin_step + 1, p.W, p.C),
                                              self.x_dtype, x_scale, self.weights, bias,
                                              **options)
        threads = get_num_threads()
        plan = twin._plans.get(threads) or twin._taps_plan()
        # this thread's buffers, kept from call to call (a network calls the layer
        # again), the input's with room for amx tiles to read all of it in place
        x_flat, held, x_nhwc, codes_flat, codes = self._twin_buffers(plan.room, out)
        x = x.reshape(-1)
        if threads == 1 or p.N == 1:
            self._channels_last(x, x_flat, 0, p.N)
            plan(x_nhwc, codes, held=held)
            transpose_bytes(codes_flat, out.reshape(-1), (p.Ho * p.Wo, p.K), 0, p.N)
            return out
        shares = _image_shares(p.N)
        run_shares(lambda n0, n1: self._channels_last(x, x_flat, n0, n1), shares)
        plan(x_nhwc, codes, held=held)
        run_shares(lambda n0, n1: transpose_bytes(codes_flat, out.reshape(-1),
                                                  (p.Ho * p.Wo, p.K), n0, n1), shares)
        return out

    def _channels_last(self, x, x_flat, n0, n1):
        """Images ``n0:n1`` of the flat NCHW ``x`` channels-last into ``x_flat``, the
        twin's input: every row, or every ``_twin_step``-th."""
        p = self.params
        if self._twin_step > 1:
            transpose_rows(x, x_flat, (p.C, p.H, p.W), self._twin_step, n0, n1)
        else:
            transpose_bytes(x, x_flat, (p.C, p.H * p.W), n0, n1)

    def _twin_buffers(self, room, out):
        """This thread's buffers of the twin (:meth:`_twin_into`): the input's
        (channels-last, flat and shaped, and as bytes with ``room`` more after it)
        and the twin's codes (flat and shaped); the same views while the buffers
        stay."""
        size = int(np.prod(self._twin.input_shape))
        made = buffers(("qconv2d twin",), (size + room, out.size), np.uint8)
        views = getattr(self._local, "twin", None)
        if views is None or views[0] is not made or views[1] != room:
            held, codes = made[0][:size + room], made[1][:out.size].view(out.dtype)
            x_flat = held[:size].view(self.x_dtype)
            views = self._local.twin = (made, room, x_flat, held,
                                        x_flat.reshape(self._twin.input_shape), codes,
                                        codes.reshape(self._twin.output_shape))
        return views[2:]

    def _checked_residual(self, residual):
        """``residual`` as C-contiguous codes of the output's shape and the residual's
        dtype (ValueError otherwise)."""
        if not isinstance(residual, np.ndarray) or residual.shape != self.output_shape \
                or residual.dtype != self.residual_dtype:
            raise ValueError(f"qconv2d: the residual must be {self.residual_dtype} codes of shape "
                             f"{self.output_shape}, got {getattr(residual, 'dtype', None)} "
                             f"{np.shape(residual)}")
        return np.ascontiguousarray(residual)

    def _summed_into(self, x, residual, out):
        """``out`` = the residual sum of the conv of ``x``: in the taps kernel's chunks
        (NHWC), else the conv's codes whole, then the sum."""
        p = self.params
        if p.layout == "NHWC" and taps_serve(self.weights.kind, p.Cg, p.groups):
            return self._taps_plan()(np.ascontiguousarray(x), out, residual)
        codes = self._into(x, np.empty(self.output_shape, self.codes_dtype))
        ordered = (codes, residual) if self.summed[5] else (residual, codes)
        add_codes(ordered[0].reshape(-1), ordered[1].reshape(-1), *self.summed[:5],
                  out.reshape(-1))
        return out

    def _taps_plan(self):
        """The :class:`TapsPlan` of this layer for the current thread count (cached)."""
        threads = get_num_threads()
        plan = self._plans.get(threads)
        if plan is None:
            summed = None if self.params.layout != "NHWC" or self.summed is None \
                else self.summed + (self.codes_dtype,)
            p = self.params
            taps = self.weights.taps(p.groups, self.taps_shape)
            plan = self._plans[threads] = TapsPlan(p, self.x_dtype, self.zero, taps,
                                                   self.epilogue, threads, summed)
        return plan


#: :class:`PreparedQConv`'s paths: lanes over channels; an NCHW layer as its NHWC twin;
#: the taps kernel; patches on the GEMM.
_DEPTHWISE, _TWIN, _TAPS, _PATCHES = range(4)


class QuantizedSum(NamedTuple):
    """A QDQ residual sum after a quantized conv (:class:`PreparedQConv`'s
    ``residual``): ``Q(act(DQ(conv codes) + DQ(residual)))``, ONNX's DequantizeLinear,
    Add, [Relu,] QuantizeLinear on the conv's codes and the residual's.

    Attributes
    ----------
    scale, zero_point : float, int
        The residual's quantization (its codes' dtype: ``zero_point``'s when it is a
        numpy int8 or uint8 scalar, else uint8).
    out_scale, out_zero_point : float, int
        The sum's, likewise.
    activation : None or "relu"
        Applied to the sum before it is quantized.
    conv_first : bool
        Whether the conv's codes are the Add's first operand (the float32 sum is the
        same either way; kept as the model writes it).
    """
    scale: float
    zero_point: int
    out_scale: float
    out_zero_point: int
    activation: object = None
    conv_first: bool = True


def _summed(s, requant, codes_dtype, func):
    """``(sum dtype, residual dtype, summed)`` of :class:`QuantizedSum` ``s`` after codes
    of ``requant``: ``summed = (scales, zeros, relu, low, high, conv_first)`` as
    :func:`tilegemm.kernels.requant.add_codes` takes them (conv's operand first)."""
    check_choice(s.activation, (None, "relu"), "residual activation", func)
    dtypes = [np.dtype(type(z)) if isinstance(z, np.integer) and np.dtype(type(z)) in INT8_DTYPES
              else np.dtype(np.uint8) for z in (s.zero_point, s.out_zero_point)]
    zeros = [zero_point(z, d, name, func) for z, d, name in
             ((s.zero_point, dtypes[0], "the residual's zero point"),
              (s.out_zero_point, dtypes[1], "the sum's zero point"))]
    scales = [requant[0], _positive(s.scale, "the residual's scale", func),
              _positive(s.out_scale, "the sum's scale", func)]
    zs = [int(requant[1])] + zeros
    order = [0, 1, 2] if s.conv_first else [1, 0, 2]
    low, high = RANGES[dtypes[1]]
    return dtypes[1], dtypes[0], (np.array([scales[i] for i in order], np.float32),
                                  np.array([zs[i] for i in order], np.int64),
                                  s.activation == "relu", np.float32(low), np.float32(high),
                                  bool(s.conv_first))


#: :func:`qconv2d`'s keyword arguments and their defaults.
QCONV_OPTIONS = dict(x_zero_point=0, stride=1, padding=0, dilation=1, groups=1, activation=None,
                     out_scale=None, out_zero_point=0, layout="NCHW")


#: Fewest input and output channels of an NCHW layer run as its NHWC twin: a 16 x 16
#: block of the transposes must hold channels (the 3-channel stem's input stays on
#: the widening's own transposition).
TWIN_MIN_CHANNELS = 16


def _image_shares(N):
    """``(n0, n1)`` runs of images for the threads (one run below two images)."""
    parts = max(1, min(get_num_threads(), N))
    cuts = [N * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def _output(out_scale, out_zero_point, x_dtype, bias, func):
    """The output dtype and the epilogue's ``requant`` tuple (scale 0: float output)."""
    if out_scale is None:
        return np.dtype(np.float32), (0.0, 0.0, 0.0, 0.0)
    typed = isinstance(out_zero_point, np.integer) and np.dtype(type(out_zero_point)) in INT8_DTYPES
    dtype = np.dtype(type(out_zero_point)) if typed else np.dtype(x_dtype)
    if not np.isfinite(bias).all():
        raise ValueError(f"{func}: bias holds NaN or infinite values, which have no quantized code")
    zp = zero_point(out_zero_point, dtype, "out_zero_point", func)
    low, high = RANGES[dtype]
    scale = _positive(out_scale, "out_scale", func)
    return dtype, (scale, float(zp), float(low), float(high))
