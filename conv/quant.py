"""Quantized arithmetic: quantize / dequantize, and the exact int8 matrix product.

* :func:`quantize`: float -> int8 (symmetric, scale = max|x| / 127) or uint8 (affine,
  with a zero point, as ONNX's QuantizeLinear), per tensor or per channel.
* :func:`dequantize`: back to float, for int8, uint8 and int32 accumulators.
* :func:`qmatmul`: ``(a - a_zero_point) @ (b - b_zero_point)`` of int8/uint8 operands
  with numpy matmul semantics, summed exactly in int32 on the int8 micro-kernels
  (``kernels/int8.py``); a product whose sum could leave int32 is refused.
"""
import functools

import numpy as np

from tilegemm.ground.validate import (as_array, check_out, float_array, matmul_shapes, overlaps,
                                      refuse_masked)
from tilegemm.kernels.qgemm import matrix_kind_for, qgemm_into

INT8_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))
INT32_MAX = 2 ** 31 - 1
#: (min, max) of each quantized dtype (np.iinfo costs a microsecond a call).
RANGES = {np.dtype(np.int8): (-128, 127), np.dtype(np.uint8): (0, 255)}


def int8_array(x, name, func):
    """``x`` as a plain int8 or uint8 ndarray; TypeError naming the dtype otherwise."""
    if type(x) is np.ndarray and x.dtype in INT8_DTYPES:    # the common case, at once
        return x
    x = np.asarray(refuse_masked(as_array(x, name, func), name, func))
    if x.dtype not in INT8_DTYPES:
        raise TypeError(f"{func}: {name} has dtype {x.dtype}; quantized operands are int8 or "
                        "uint8 (see tilegemm.quantize)")
    return x


def zero_point(value, dtype, name, func):
    """A zero point as a Python int in ``dtype``'s range (TypeError / ValueError otherwise)."""
    if type(value) is not int and (isinstance(value, (bool, np.bool_))
                                   or not isinstance(value, (int, np.integer))):
        raise TypeError(f"{func}: {name} must be an integer, got {type(value).__name__}")
    low, high = RANGES[np.dtype(dtype)]
    if not low <= value <= high:
        raise ValueError(f"{func}: {name} = {value} is outside {np.dtype(dtype)}'s range "
                         f"[{low}, {high}]")
    return int(value)


@functools.lru_cache(maxsize=64)      # every qmatmul and qconv2d call asks
def overflow_bound(a_dtype, a_zero_point, b_dtype, b_zero_point):
    """The largest k for which every ``(a - za) @ (b - zb)`` of these dtypes fits in
    int32: ``INT32_MAX // (max|a - za| * max|b - zb|)`` over the dtypes' ranges."""
    def widest(dtype, z):
        low, high = RANGES[np.dtype(dtype)]
        return max(z - low, high - z)
    return INT32_MAX // (widest(a_dtype, a_zero_point) * widest(b_dtype, b_zero_point))


def qmatmul(a, b, /, out=None, *, a_zero_point=0, b_zero_point=0):
    """Exact quantized matrix product ``(a - a_zero_point) @ (b - b_zero_point)`` in int32.

    numpy.matmul semantics: 1-D operands are promoted to a row (``a``) or a column
    (``b``) and the added axis removed from the result; leading (batch) dimensions
    broadcast.  Bit-exact against ``(a.astype(np.int64) - a_zero_point) @
    (b.astype(np.int64) - b_zero_point)``.

    Parameters
    ----------
    a, b : array_like of int8 or uint8
        Any strides; never modified.
    out : ndarray of int32, optional
        Destination of exactly the result's shape; it may overlap the inputs.
    a_zero_point, b_zero_point : int
        Subtracted from every value of ``a`` / ``b``; within the operand dtype's range.

    Returns
    -------
    ndarray of int32
        The product (``out`` when given).

    Raises
    ------
    TypeError
        Operands that are not int8/uint8, zero points that are not integers, an
        ``out`` that is not an int32 ndarray.
    ValueError
        0-d operands, mismatched inner dimensions, batch shapes that do not
        broadcast, zero points out of range, an ``out`` of the wrong shape or
        read-only, or a k so long that the int32 sum could overflow
        (:func:`overflow_bound` names the largest k allowed).
    """
    func = "qmatmul"
    if (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == 2 and b.ndim == 2
            and a.dtype in INT8_DTYPES and b.dtype in INT8_DTYPES
            and (out is None or _plain_out(out, a, b))):
        return _plain_2d(a, b, a_zero_point, b_zero_point, out)
    a, b = int8_array(a, "a", func), int8_array(b, "b", func)
    za = zero_point(a_zero_point, a.dtype, "a_zero_point", func)
    zb = zero_point(b_zero_point, b.dtype, "b_zero_point", func)
    a2, b2, m, k, n, batch, shape, out_shape = matmul_shapes(a, b, func)
    check_bound(k, a.dtype, za, b.dtype, zb)
    dest = None if out is None else check_out(out, out_shape, np.dtype(np.int32), func)
    target = dest
    if dest is None or not dest.flags.c_contiguous or overlaps(dest, a, b):
        target = np.empty(out_shape, np.int32)
    result = target.reshape(shape)   # a view: only length-1 axes were dropped
    kind = matrix_kind_for(b2, zb, m)    # one range check for every batch's B
    if not batch:      # broadcast views are read-only: Numba's dispatch took 30 us more
        qgemm_into(a2, b2, result, za, zb, kind, proved=True)
    else:
        a_b = np.broadcast_to(a2, batch + (m, k))
        b_b = np.broadcast_to(b2, batch + (k, n))
        for at in np.ndindex(*batch):
            qgemm_into(a_b[at], b_b[at], result[at], za, zb, kind, proved=True)
    if dest is None:
        return target
    if target is not dest:
        dest[...] = target
    return out


def _plain_out(out, a, b):
    """Whether ``out`` can take a 2-D product of ``a`` and ``b`` as it is: a writable,
    C-contiguous int32 ndarray of the product's shape sharing no memory with them
    (anything else takes :func:`qmatmul`'s general path, which checks and copies)."""
    return (type(out) is np.ndarray and out.dtype == np.int32 and out.ndim == 2
            and out.shape == (a.shape[0], b.shape[1]) and out.flags.c_contiguous
            and out.flags.writeable
            and not (np.may_share_memory(out, a) or np.may_share_memory(out, b)))


def _plain_2d(a, b, a_zero_point, b_zero_point, out=None):
    """:func:`qmatmul` of two 2-D ndarrays of int8/uint8 into a new array or an ``out``
    that :func:`_plain_out` admits: the same checks, without the broadcasting that
    costs a small product as much as its arithmetic."""
    func = "qmatmul"
    za = zero_point(a_zero_point, a.dtype, "a_zero_point", func)
    zb = zero_point(b_zero_point, b.dtype, "b_zero_point", func)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"{func}: shapes {a.shape} and {b.shape} are not aligned: "
                         f"{k} (last dim of a) != {k2} (dim -2 of b)")
    check_bound(k, a.dtype, za, b.dtype, zb)
    c = np.empty((m, n), np.int32) if out is None else out
    return qgemm_into(a, b, c, za, zb, matrix_kind_for(b, zb, m), proved=True)


def check_bound(k, a_dtype, za, b_dtype, zb, func="qmatmul"):
    """ValueError unless every sum of k products of these operands fits in int32
    (:func:`overflow_bound`), naming the largest k allowed."""
    bound = overflow_bound(a_dtype, za, b_dtype, zb)
    if k > bound:
        raise ValueError(f"{func}: k = {k} could overflow the int32 sum: for {a_dtype} with "
                         f"zero point {za} and {b_dtype} with zero point {zb}, k must be at "
                         f"most {bound}")


def _channel_shape(x, axis, func):
    """The shape a per-channel value along ``axis`` broadcasts with over ``x``."""
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{func}: axis {axis} is out of range for {x.ndim}-D input")
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return tuple(shape)


def _reduce(x, fn, axis):
    """``fn`` over every axis of ``x`` but ``axis`` (all of them for None), kept as
    dimensions of size 1 so that the result broadcasts against ``x``; zeros where
    there is nothing to reduce (an empty tensor or channel)."""
    shape = (1,) * x.ndim if axis is None else _channel_shape(x, axis, "quantize")
    if x.size == 0:
        return np.zeros(shape, x.dtype)
    if axis is None:
        return fn(x, axis=None, keepdims=True)
    keep = axis % x.ndim
    return fn(x, axis=tuple(i for i in range(x.ndim) if i != keep), keepdims=True)


def quantize(x, *, axis=None, dtype=np.int8):
    """Quantize a float array to int8 (symmetric) or uint8 (affine), per tensor or per channel.

    * int8: ``scale = max|x| / 127``, ``q = clip(round(x / scale), -127, 127)``.
    * uint8: the range ``[min(x, 0), max(x, 0)]`` onto [0, 255]: ``scale = (hi - lo) /
      255``, ``zero_point = round(-lo / scale)``, ``q = clip(round(x / scale) +
      zero_point, 0, 255)``, as ONNX's QuantizeLinear computes it.

    Rounding is half to even; values saturate.  A tensor (or channel) of zeros gets
    scale 1.

    Parameters
    ----------
    x : array_like of float32 or float64
        Finite values.
    axis : int, optional
        Channel axis: one scale (and zero point) per index along it.  None: one for
        the whole tensor.
    dtype : {numpy.int8, numpy.uint8}

    Returns
    -------
    (q, scale) for int8, (q, scale, zero_point) for uint8
        ``scale`` in ``x``'s float dtype and ``zero_point`` as int32: 0-d for a whole
        tensor, 1-D (length ``x.shape[axis]``) per channel.

    Raises
    ------
    TypeError
        ``x`` not float32/float64, or another ``dtype``.
    ValueError
        NaN or infinite values (they have no integer code), ``axis`` out of range.
    """
    func = "quantize"
    x = float_array(x, "x", func)
    dtype = np.dtype(dtype)
    if dtype not in INT8_DTYPES:
        raise TypeError(f"{func}: dtype must be int8 or uint8, got {dtype}")
    if not np.isfinite(x).all():
        raise ValueError(f"{func}: x holds NaN or infinite values, which have no quantized code")
    if axis is not None:
        _channel_shape(x, axis, func)
    one = x.dtype.type(1)
    if dtype == np.int8:
        scale = (_reduce(np.abs(x), np.max, axis) / x.dtype.type(127)).astype(x.dtype)
        scale = np.where(scale > 0, scale, one).astype(x.dtype)
        q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
        return q, _squeeze(scale, axis)
    lo = np.minimum(_reduce(x, np.min, axis), 0)
    hi = np.maximum(_reduce(x, np.max, axis), 0)
    scale = ((hi - lo) / x.dtype.type(255)).astype(x.dtype)
    scale = np.where(scale > 0, scale, one).astype(x.dtype)
    zp = np.clip(np.rint(-lo / scale), 0, 255).astype(np.int32)
    q = np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8)
    return q, _squeeze(scale, axis), _squeeze(zp, axis)


def _squeeze(value, axis):
    """A per-tensor value as a 0-d array, a per-channel one as 1-D."""
    return value.reshape(()) if axis is None else value.reshape(-1)


def dequantize(q, scale, zero_point=0, *, axis=None):
    """``(q - zero_point) * scale`` as floats: the inverse of :func:`quantize`.

    Parameters
    ----------
    q : array_like of int8, uint8 or int32
        int32 for products' accumulators (scale: the product of the operands' scales).
    scale : float or array_like of float
        Positive and finite; 0-d, or 1-D along ``axis``.  float64 gives a float64
        result, anything else float32.
    zero_point : int or array_like of int
        As ``scale``.
    axis : int, optional
        The channel axis of a 1-D ``scale`` / ``zero_point``.

    Returns
    -------
    ndarray of float32 (float64 for a float64 scale)

    Raises
    ------
    TypeError
        ``q`` of another dtype.
    ValueError
        Scales that are zero, negative or not finite; scale or zero-point shapes that
        do not match ``axis``.
    """
    func = "dequantize"
    q = np.asarray(refuse_masked(as_array(q, "q", func), "q", func))
    if q.dtype not in INT8_DTYPES + (np.dtype(np.int32),):
        raise TypeError(f"{func}: q has dtype {q.dtype}; expected int8, uint8 or int32")
    scale_arr = np.asarray(scale)
    out_dtype = np.float64 if scale_arr.dtype == np.float64 else np.float32
    scale_arr = scale_arr.astype(out_dtype)
    if not (np.isfinite(scale_arr).all() and (scale_arr > 0).all()):
        raise ValueError(f"{func}: scale must be positive and finite")
    zp = np.asarray(zero_point)
    if zp.dtype.kind not in "iu":
        raise TypeError(f"{func}: zero_point must be integers, got dtype {zp.dtype}")
    shape = () if axis is None else _channel_shape(q, axis, func)
    for name, v in (("scale", scale_arr), ("zero_point", zp)):
        if v.ndim and (axis is None or v.shape != (q.shape[axis],)):
            raise ValueError(f"{func}: {name} has shape {v.shape}; expected a scalar"
                             + ("" if axis is None else f" or ({q.shape[axis]},) along axis {axis}"))
    scale_b = scale_arr.reshape(shape) if scale_arr.ndim else scale_arr
    zp_b = zp.astype(np.int64).reshape(shape) if zp.ndim else np.int64(zp)
    return ((q.astype(np.int64) - zp_b) * scale_b).astype(out_dtype)
