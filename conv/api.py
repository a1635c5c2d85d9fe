"""The public convolution entry points: :func:`conv2d`, :class:`ConvWeights` and
:func:`fold_batchnorm`.

Everything is validated here in plain Python; the algorithms below receive
C-contiguous arrays of one float dtype and a :class:`~tilegemm.conv.params.ConvParams`.
"""
import functools
import numbers
import os

import numpy as np

from tilegemm.conv import engine, paths, winograd
from tilegemm.conv.params import ACTIVATIONS, ALGORITHMS, conv_params
from tilegemm.conv.plan import choose
from tilegemm.ground.contracts import EPI_RELU, EPI_RELU6
from tilegemm.ground.interop import any_tensor, numpy_view, to_tensor
from tilegemm.kernels.pool import for_slices
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.validate import check_choice, float_array

_ACT_FLAGS = {None: 0, "relu": EPI_RELU, "relu6": EPI_RELU6}


@functools.lru_cache(maxsize=256)
def _auto(p, dtype, threads, forced):
    """``(algorithm, winograd_tile)`` of the plan for ``p``: the cost model costs tens of
    microseconds, a whole depthwise layer two milliseconds.  ``forced`` (the
    environment override) is part of the key so that setting it takes effect."""
    plan = choose(p, np.dtype(dtype), threads)
    return plan.algorithm, plan.winograd_tile


def _trivial(x, bias, out, p, act):
    """Convolutions with nothing to sum (no input channels): bias then activation."""
    out[...] = 0
    if bias is not None:
        shape = (1, -1, 1, 1) if p.layout == "NCHW" else (1, 1, 1, -1)
        out += bias.reshape(shape)
    return _activate(out, act)


class ConvWeights:
    """Convolution weights prepared once, for many :func:`conv2d` calls.

    Holds its own read-only copy of ``weight``.  What each algorithm builds from it
    (Winograd's ``G g G^T``, packed panels) is built on first use and kept with
    this object, and calls never compare the weights again.  With a plain array,
    :func:`conv2d` keeps what it built for the last 32 arrays and compares the
    array with a copy on every call, to notice changes made in place, work only the
    calling thread does.

    Parameters
    ----------
    weight : array_like, float32 or float64, shape (K, C/groups, kh, kw)

    Raises
    ------
    TypeError
        A non-float weight.
    ValueError
        A weight that is not 4-D.

    Examples
    --------
    >>> w = tilegemm.ConvWeights(weight)            # once
    >>> y = tilegemm.conv2d(x, w, bias, padding=1)  # every call

    Changing ``weight`` afterwards does not change the object; with an input of
    another dtype (float64 input, float32 weights) the weights are cast per call
    and cached like a plain array.
    """

    __slots__ = ("_frozen",)     # the copy and what is built from it (engine.Frozen)

    def __init__(self, weight):
        if isinstance(weight, ConvWeights):
            weight = weight._frozen.array
        w = float_array(numpy_view(weight, "weight", "ConvWeights"), "weight", "ConvWeights")
        if w.ndim != 4:
            raise ValueError(f"ConvWeights: weight must be 4-D (K, C/groups, kh, kw), "
                             f"got shape {w.shape}")
        w = np.array(w, order="C", copy=True)
        w.flags.writeable = False
        self._frozen = engine.freeze(w)

    @property
    def shape(self):
        """(K, C/groups, kh, kw)."""
        return self._frozen.array.shape

    @property
    def dtype(self):
        """float32 or float64."""
        return self._frozen.array.dtype

    def __repr__(self):
        return f"ConvWeights(shape={self.shape}, dtype={self.dtype})"


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
           activation=None, algorithm="auto", layout="NCHW", winograd_tile=None,
           residual=None, out=None, **internal):
    """2-D convolution (cross-correlation) with the semantics of ``torch.nn.functional.conv2d``.

    Parameters
    ----------
    input : array_like, float32 or float64
        ``(N, C, H, W)``, or ``(N, H, W, C)`` with ``layout="NHWC"``.
    weight : array_like or ConvWeights, shape (K, C/groups, kh, kw)
        The same for both layouts.  :class:`ConvWeights` for weights used many times.
    bias : array_like, shape (K,), optional
    stride, dilation : int or (int, int)
        Positive.
    padding : int, (int, int), "valid" or "same"
        Zero padding on each side; "same" (stride 1 only) may pad one more
        row/column at the bottom/right, as torch does.
    groups : int
        Divides C and K; ``groups == C == K`` is a depthwise convolution.
    activation : None, "relu" or "relu6"
        Applied after the bias (and the residual), fused into the algorithm's
        epilogue.  NaN stays NaN (relu(NaN) is NaN).  With Winograd a NaN or Inf in the input makes every output
        of the 2x2 tiles it touches non-finite (the transforms mix a 4x4 input tile).
    algorithm : "auto", "im2col", "winograd" or "direct"
        "auto" asks :func:`tilegemm.conv_plan`'s cost model; "winograd" needs a
        3x3 kernel, stride 1 and dilation 1.
    layout : "NCHW" or "NHWC"
        Layout of ``input`` and of the result; NHWC is computed natively.
    winograd_tile : None, 2, 4 or 6
        With ``algorithm="winograd"``: the output tile size m of F(m x m, 3x3).  None
        lets the cost model choose (:attr:`ConvPlan.winograd_tile`).  Larger tiles do
        fewer multiplications and round more (docs/conv-paths.md states the bounds).
    residual : array_like, optional
        Of the result's shape: the result is ``activation(conv + bias + residual)``,
        a skip connection summed before the activation.  It may be ``out`` itself.
    out : ndarray, optional
        Where to write the result (returned): writeable, C-contiguous, the result's
        shape and dtype, overlapping none of ``input``, ``weight``, ``bias``.
    _path : keyword only
        Internal, for tests (``**internal`` takes no other): force a path of
        :data:`tilegemm.conv.paths.PATHS` that serves the layer (``algorithm`` is ignored).

    Returns
    -------
    ndarray
        ``(N, K, Ho, Wo)`` or ``(N, Ho, Wo, K)``, dtype ``result_type(input, weight, bias)``.
        Inputs are never modified.

    Raises
    ------
    TypeError
        Non-float arrays; non-integer stride, padding, dilation or groups.
    ValueError
        Wrong ranks, channel or group mismatch, non-positive stride or dilation,
        negative padding, an empty output, a bias of the wrong length, an unknown
        algorithm/activation/layout, an algorithm that does not apply, a residual of
        another shape, or an unusable ``out``.
    """
    _path = _internal_args(internal)
    if any_tensor(input, weight, bias, residual, out):
        return _on_tensors((input, weight, bias, residual, out), (stride, padding, dilation, groups),
                           dict(activation=activation, algorithm=algorithm, layout=layout,
                                winograd_tile=winograd_tile, _path=_path))
    x, w, b, p = _operands(input, weight, bias, (stride, padding, dilation, groups, layout),
                           algorithm, activation)
    _check_tile(winograd_tile, p, algorithm if _path is None else _path.partition(".")[0])
    dtype = np.result_type(x, w, *(() if b is None else (b,)))
    r = None if residual is None else _residual(residual, p)
    out = np.empty(p.output_shape(), dtype) if out is None else _checked_out(out, p, dtype,
                                                                             (x, w, b))
    act = _ACT_FLAGS[activation]
    x, w, b = (None if a is None else np.ascontiguousarray(a, dtype=dtype) for a in (x, w, b))
    if _path is not None:
        _check_forced(_path, p, dtype)
    if out.size == 0:
        return out
    return _compute((x, w, b, r), out, p, act, _route(p, out.dtype, algorithm, winograd_tile,
                                                      _path) if p.Cg else None)


def _compute(operands, out, p, act, route):
    """The convolution of checked contiguous ``operands`` (x, w, b, residual) into
    ``out`` on ``route`` ((path, Winograd tile); None: no input channels)."""
    x, w, b, r = operands
    if route is None:
        return _trivial(x, b, out, p, act) if r is None else _with_residual(
            out, r, act, lambda dst: _trivial(x, b, dst, p, 0))
    path, tile = route
    if r is None:
        return paths.run(path, x, w, b, out, p, act, tile)
    return _summed(out, r, act, paths.accumulates(path, p), lambda dst, act, add: paths.run(
        path, x, w, b, dst, p, act, tile, accumulate=add))


class PreparedConv:
    """A convolution bound to one input shape and dtype, validated and planned once:
    each call checks only the input it gets.  For a network that runs the same
    layer many times; :func:`conv2d` does the whole check on every call.

    Parameters
    ----------
    input_shape : tuple of int
        ``(N, C, H, W)`` (``(N, H, W, C)`` with ``layout="NHWC"``).
    weight, bias, stride, padding, dilation, groups, activation, algorithm, layout,
    winograd_tile
        As for :func:`conv2d`.
    dtype : float32 or float64
        The input's dtype.

    Calling it, ``conv(x, residual=None, out=None)``, returns what
    ``conv2d(x, weight, bias, ..., residual=residual, out=out)`` returns; ``x`` must
    be an ndarray of ``input_shape`` and ``dtype`` (TypeError/ValueError otherwise).
    """

    def __init__(self, input_shape, weight, bias=None, stride=1, padding=0, dilation=1,
                 groups=1, *, activation=None, algorithm="auto", layout="NCHW",
                 dtype=np.float32, winograd_tile=None):
        p, self.dtype, w, b = PreparedConv.checked(
            input_shape, weight, bias, stride, padding, dilation, groups, activation=activation,
            algorithm=algorithm, layout=layout, dtype=dtype, winograd_tile=winograd_tile)
        self.input_shape, self.params = tuple(input_shape), p
        self._x_dtype = np.dtype(dtype)
        self._w, self._b = (None if a is None else np.ascontiguousarray(a, dtype=self.dtype)
                            for a in (w, b))
        self._act = _ACT_FLAGS[activation]
        self._path = None if p.Cg == 0 else _route(p, self.dtype, algorithm, winograd_tile, None)
        self._runner = None if self._path is None else paths.bind(
            self._path[0], self._w, self._b, p, self.dtype, self._path[1])

    @staticmethod
    def checked(input_shape, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
                activation=None, algorithm="auto", layout="NCHW", dtype=np.float32,
                winograd_tile=None):
        """Check a layer as :func:`conv2d` would, without preparing or running it.

        Returns
        -------
        tuple
            ``(params, dtype, weight, bias)``: the validated geometry
            (:class:`~tilegemm.conv.params.ConvParams`, its ``layout`` upper-case),
            the result's dtype, and the weight and bias as arrays.

        Raises
        ------
        TypeError, ValueError
            As :func:`conv2d` would for an input of ``input_shape`` and ``dtype``.
        """
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"PreparedConv: dtype must be float32 or float64, got {dtype}")
        stub = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), tuple(input_shape),
                                               (0,) * len(input_shape))
        _, w, b, p = _operands(stub, weight, bias, (stride, padding, dilation, groups, layout),
                               algorithm, activation, "PreparedConv")
        _check_tile(winograd_tile, p, algorithm)
        return p, np.result_type(dtype, w, *(() if b is None else (b,))), w, b

    @property
    def output_shape(self):
        return self.params.output_shape()

    def __call__(self, x, residual=None, out=None):
        if not isinstance(x, np.ndarray) or x.dtype != self._x_dtype:
            raise TypeError(f"PreparedConv: input must be a {self._x_dtype} ndarray, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.shape != self.input_shape:
            raise ValueError(f"PreparedConv: input must have shape {self.input_shape}, got "
                             f"{x.shape}")
        p = self.params
        r = None if residual is None else _residual(residual, p)
        out = (np.empty(p.output_shape(), self.dtype) if out is None
               else _checked_out(out, p, self.dtype, (x,)))
        x = np.ascontiguousarray(x, dtype=self.dtype)
        if out.size == 0:
            return out
        if r is None:
            return self._run(x, out, self._act, False)
        return _summed(out, r, self._act, self.accumulates,
                       lambda dst, act, add: self._run(x, dst, act, add))

    @property
    def path(self):
        """The path that runs the layer (:data:`tilegemm.conv.paths.PATHS`), with the
        Winograd tile size, e.g. ``"winograd.nhwc F(4)"``; ``""`` without input channels."""
        if self._path is None:
            return ""
        path, tile = self._path
        return f"{path} F({tile})" if path.startswith("winograd") else path

    @property
    def accumulates(self):
        """Whether a residual is summed in the path's epilogue: then ``out`` may be the
        residual at no cost (otherwise the sum is a pass after the convolution, and an
        ``out`` that is the residual needs a scratch copy)."""
        return self._path is not None and paths.accumulates(self._path[0], self.params)

    def runner_for(self, out, residual=None):
        """``run(x)``: this convolution of ``x`` into ``out``, the checks skipped, for
        a caller that repeats a call ``self(x, residual, out=out)`` already accepted on
        the same buffers (a network's replayed runs); ``x`` must again have
        ``input_shape`` and the input's dtype.  ``residual`` is given only as ``out``
        itself (summed in the path's epilogue).  None where the call does more than
        the path's run (no input channels, an empty output, a residual summed in a
        pass of its own)."""
        accumulate = residual is not None
        if self._path is None or out.size == 0 or (
                accumulate and (out is not residual or not self.accumulates)):
            return None
        run, act, dtype = self._runner, self._act, self.dtype
        return lambda x: run(np.ascontiguousarray(x, dtype=dtype), out, act, accumulate)

    def _run(self, x, out, act, accumulate):
        if self._path is None:
            return _trivial(x, self._b, out, self.params, act)
        return self._runner(x, out, act, accumulate)


def _on_tensors(operands, geometry, options):
    """conv2d on torch tensors: their memory as arrays, a tensor back (``out`` if given)."""
    names = ("input", "weight", "bias", "residual", "out")
    x, w, b, r, o = (numpy_view(v, n, "conv2d", written=n == "out")
                     for n, v in zip(names, operands))
    result = conv2d(x, w, b, *geometry, residual=r, out=o, **options)
    return operands[4] if operands[4] is not None else to_tensor(result)


def _summed(out, residual, act, accumulates, run):
    """``act(conv + residual)`` into ``out``: in the path's epilogue when it
    ``accumulates`` (``out`` first holds the residual: nothing to copy when it is the
    residual), else a pass after it.  ``run(dst, act, accumulate)`` runs the path."""
    if accumulates and (out is residual or not np.shares_memory(out, residual)):
        if out is not residual:
            np.copyto(out, residual)
        return run(out, act, True)
    return _with_residual(out, residual, act, lambda dst: run(dst, 0, False))


def _with_residual(out, residual, act, conv_into):
    """``act(conv + residual)`` into ``out``: ``conv_into(dst)`` writes the convolution
    (bias included, no activation) into ``dst``; a scratch array when ``out`` holds
    the residual, whose values the sum still needs."""
    dst = np.empty_like(out) if np.shares_memory(out, residual) else out
    conv_into(dst)
    axis = 0 if out.shape[0] >= 2 else 1         # the threads take images, else channels

    def part(s):                                 # sum and activation while it is in cache
        at = (slice(None),) * axis + (s,)
        _activate(np.add(dst[at], residual[at], out=out[at]), act)
    for_slices(part, out.shape[axis], out.size)
    return out


def _activate(out, act):
    """``out`` through relu/relu6 in place; NaN stays NaN (np.maximum propagates it)."""
    if act & (EPI_RELU | EPI_RELU6):
        np.maximum(out, 0, out=out)
    if act & EPI_RELU6:
        np.minimum(out, 6, out=out)
    return out


def _route(p, dtype, algorithm, tile, path):
    """``(path, winograd_tile)`` conv2d runs: the plan's where the caller left them open."""
    if path is None or (tile is None and path.startswith("winograd")):
        planned, planned_tile = _auto(p, np.dtype(dtype).str, get_num_threads(),
                                      os.environ.get("TILEGEMM_CONV_ALGORITHM"))
        algorithm = planned if algorithm == "auto" else algorithm
        tile = planned_tile if tile is None else tile
    if path is None:
        path = paths.path_of(p, algorithm, dtype)
    return path, tile


def _internal_args(internal):
    """``_path`` from conv2d's ``**internal``; any other keyword is a TypeError."""
    unknown = set(internal) - {"_path"}
    if unknown:
        raise TypeError(f"conv2d() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    return internal.get("_path")


def _check_tile(tile, p, algorithm):
    """``winograd_tile`` is None, or one of the Winograd drivers' tile sizes given with
    the Winograd algorithm."""
    if tile is None:
        return
    if isinstance(tile, (bool, np.bool_)) or not isinstance(tile, numbers.Integral):
        raise TypeError(f"conv2d: winograd_tile must be an integer, got {tile!r}")
    if tile not in winograd.TILES:
        raise ValueError(f"conv2d: winograd_tile must be one of {winograd.TILES}, got {tile}")
    if algorithm != "winograd":
        raise ValueError(f"conv2d: winograd_tile={tile} applies to algorithm='winograd', "
                         f"not {algorithm!r}")


def _operands(input, weight, bias, geometry, algorithm, activation, func="conv2d"):
    """``conv2d``'s arrays (float, not yet cast) and :class:`ConvParams`, validated.

    ``geometry`` is ``(stride, padding, dilation, groups, layout)``."""
    if isinstance(weight, ConvWeights):
        weight = weight._frozen.array
    check_choice(algorithm, ALGORITHMS, "algorithm", func)
    check_choice(activation, ACTIVATIONS, "activation", func)
    x = float_array(input, "input", func)
    w = float_array(weight, "weight", func)
    b = None if bias is None else float_array(bias, "bias", func)
    p = conv_params(x.shape, w.shape, *geometry, func)
    if b is not None and b.shape != (p.K,):
        raise ValueError(f"{func}: bias must have shape ({p.K},) (one value per output channel), "
                         f"got {b.shape}")
    if algorithm == "winograd" and not p.winograd_ok:
        raise ValueError(f"{func}: algorithm='winograd' (F(m x m,3x3)) needs a 3x3 kernel, stride 1 "
                         f"and dilation 1; got a {p.kh}x{p.kw} kernel, stride {(p.sy, p.sx)}, "
                         f"dilation {(p.dy, p.dx)}")
    return x, w, b, p


def _check_forced(path, p, dtype):
    """A forced ``_path`` must name a path that serves ``p`` (``algorithm`` is then ignored)."""
    if path not in paths.PATHS:
        raise ValueError(f"conv2d: unknown path {path!r}; expected one of {paths.PATHS}")
    if not paths.serves(path, p, dtype):
        raise ValueError(f"conv2d: path {path!r} does not serve this layer ({p})")


def _checked_out(out, p, dtype, operands):
    """``out`` if conv2d can write its result there, else a clear error."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"conv2d: out must be a numpy array, got {type(out).__name__}")
    if (out.shape != p.output_shape() or out.dtype != dtype or not out.flags.c_contiguous
            or not out.flags.writeable):
        raise ValueError(f"conv2d: out must be a writeable C-contiguous {dtype} array of "
                         f"shape {p.output_shape()}, got a {out.dtype} array of shape {out.shape}")
    if any(a is not None and np.shares_memory(out, a) for a in operands):
        raise ValueError("conv2d: out overlaps input, weight or bias; it may only be the residual")
    return out


def _residual(residual, p):
    """The residual operand as a float array of the result's shape (not yet cast)."""
    r = float_array(residual, "residual", "conv2d")
    if r.shape != p.output_shape():
        raise ValueError(f"conv2d: residual must have the result's shape {p.output_shape()} "
                         f"({p.layout}), got {r.shape}")
    return r


def fold_batchnorm(weight, bias, gamma, beta, mean, var, eps=1e-5):
    """Fold an inference-mode BatchNorm into the preceding convolution's weights.

    Returns ``(weight', bias')`` such that ``conv2d(x, weight', bias')`` equals
    ``batchnorm(conv2d(x, weight, bias))`` with
    ``batchnorm(y) = gamma * (y - mean) / sqrt(var + eps) + beta`` per output channel.

    Parameters
    ----------
    weight : array_like, shape (K, C/groups, kh, kw)
    bias : array_like of shape (K,), or None (a zero bias)
    gamma, beta, mean, var : array_like, shape (K,)
        BatchNorm scale, shift, running mean and running variance.
    eps : float
        Non-negative.

    Returns
    -------
    (ndarray, ndarray)
        New arrays (the inputs are not modified), dtype the common float dtype.

    Raises
    ------
    TypeError
        Non-float arrays or a non-real ``eps``.
    ValueError
        Wrong ranks or lengths, negative ``eps`` or variance.
    """
    func = "fold_batchnorm"
    w = float_array(weight, "weight", func)
    if w.ndim != 4:
        raise ValueError(f"{func}: weight must be 4-D (K, C/groups, kh, kw), got shape {w.shape}")
    K = w.shape[0]
    vectors = {}
    for name, v in (("bias", bias), ("gamma", gamma), ("beta", beta), ("mean", mean),
                    ("var", var)):
        if v is None and name == "bias":
            continue
        v = float_array(v, name, func)
        if v.shape != (K,):
            raise ValueError(f"{func}: {name} must have shape ({K},) to match weight.shape[0], "
                             f"got {v.shape}")
        vectors[name] = v
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{func}: eps must be a real number, got {eps!r}")
    if eps < 0:
        raise ValueError(f"{func}: eps must be non-negative, got {eps}")
    if np.any(vectors["var"] < 0):
        raise ValueError(f"{func}: var holds negative values; it must be a variance")
    dtype = np.result_type(w, *vectors.values())
    scale = vectors["gamma"].astype(dtype) / np.sqrt(vectors["var"].astype(dtype) + dtype.type(eps))
    new_weight = w.astype(dtype) * scale.reshape(-1, 1, 1, 1)
    b0 = vectors["bias"].astype(dtype) if "bias" in vectors else np.zeros(K, dtype)
    new_bias = (b0 - vectors["mean"].astype(dtype)) * scale + vectors["beta"].astype(dtype)
    return new_weight, new_bias
