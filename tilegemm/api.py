"""Public GEMM entry points with numpy (``matmul``) and BLAS (``gemm``) semantics.

Everything is validated here in plain Python (the checks shared with conv2d are
in :mod:`tilegemm.ground.validate`); the jitted engine below assumes 2-D arrays of
one float dtype with consistent shapes.
"""
import math

import numpy as np

from tilegemm.ground.interop import any_tensor, numpy_view, to_tensor
from tilegemm.ground.validate import (FLOAT_DTYPES, check_flag, check_out, matmul_shapes,
                                      overlaps, plain_float_array, real_scalar)
from tilegemm.kernels.batched import batched_into, fast_batched
from tilegemm.kernels.driver import gemm_into
from tilegemm.kernels.matvec import matvec_into
from tilegemm.kernels.small import (matmul_small, one_thread_flops, small_call_shape,
                                    small_product)
from tilegemm.kernels.tiny import SMALL_CALLS, TINY_CALLS, record_tiny

ndarray = np.ndarray        # (a module global: ``np.ndarray`` is two lookups a call)


def _result_dtype(a, b):
    return np.result_type(a.dtype, b.dtype)


def _plain_out(out, a, b):
    """Whether ``out`` is absent, or a writeable ndarray of the exact result shape and
    dtype that shares no memory with the inputs (the fast path's only case)."""
    if out is None:
        return True
    return (type(out) is np.ndarray and out.dtype == a.dtype and out.flags.writeable
            and out.shape == (a.shape[0], b.shape[-1]) and not overlaps(out, a, b))


def matmul(a, b, /, out=None):
    """Matrix product with the semantics of :func:`numpy.matmul`.

    Parameters
    ----------
    a, b : array_like of float32 or float64
        1-D operands are promoted to a row (``a``) or a column (``b``) and the
        added axis is removed from the result.  Leading (batch) dimensions broadcast.
        float32 with float64 computes in float64.
    out : ndarray, optional
        Destination with exactly the result's shape and dtype.  It may overlap the
        inputs; the product is then formed in a temporary first.

    Returns
    -------
    ndarray
        The product (``out`` when given).  Inputs are never modified.

    Raises
    ------
    TypeError
        For dtypes other than float32/float64, or an ``out`` of the wrong type or dtype.
    ValueError
        For 0-d operands, mismatched inner dimensions, batch shapes that do not
        broadcast, or an ``out`` of the wrong shape or read-only.
    """
    if type(a) is ndarray and type(b) is ndarray:
        # A one-thread product seen before: its compiled entry, which checks the
        # layouts; here only what its argument types assume (kernels/tiny.py).  Kept
        # inline: each Python call or flag read costs a 4x4 product 5-10%.
        tiny = TINY_CALLS.get((a.shape, b.shape, a.itemsize))
        if tiny is not None and a.dtype is tiny[1] and b.dtype is tiny[1]:
            if out is None:
                c = np.empty(tiny[2], tiny[1])
                if tiny[0](a, b, c, tiny[3]):
                    return c
            elif (type(out) is ndarray and out.dtype is tiny[1] and out.ndim == 2
                  and out.flags.writeable and tiny[0](a, b, out, tiny[3])):
                return out
        c = _short_path(a, b, out)
        if c is not None:
            return c
    if (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == 2 and b.ndim == 2
            and a.dtype == b.dtype and a.dtype in FLOAT_DTYPES and _plain_out(out, a, b)):
        # The common case, kept short: tiny products are dominated by call overhead.
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} are not aligned: "
                             f"{a.shape[1]} (last dim of a) != {b.shape[0]} (dim -2 of b)")
        c = np.empty((a.shape[0], b.shape[1]), a.dtype) if out is None else out
        if (a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous
                and small_product(a, b)):
            return matmul_small(a, b, c)
        return gemm_into(a, b, c)
    if any_tensor(a, b, out):
        return _tensor_matmul(a, b, out)
    a = plain_float_array(a, "a", "matmul")
    b = plain_float_array(b, "b", "matmul")
    a2, b2, m, k, n, batch, shape, out_shape = matmul_shapes(a, b, "matmul")
    dtype = _result_dtype(a, b)
    dest = None if out is None else check_out(out, out_shape, dtype, "matmul")
    a2 = a2.astype(dtype, copy=False)
    b2 = b2.astype(dtype, copy=False)

    target = dest
    if dest is None or overlaps(dest, a, b):
        target = np.empty(out_shape, dtype)
    result = target.reshape(shape)  # a view: only length-1 axes were dropped
    _batched(a2, b2, result, batch)
    if out is None:
        return target[()] if target.ndim == 0 else target
    if target is not dest:
        dest[...] = target
    return out


def _tensor_matmul(a, b, out):
    """:func:`matmul` of torch tensors (any of a, b, out): numpy views in, a tensor out."""
    r = matmul(numpy_view(a, "a", "matmul"), numpy_view(b, "b", "matmul"),
               out=numpy_view(out, "out", "matmul", written=True))
    return out if out is not None else to_tensor(r)


def _short_path(a, b, out):
    """``a @ b`` (ndarrays) on one of matmul's short paths, or None where none applies."""
    if a.ndim == b.ndim == 2:
        if a.shape[0] == 1 or b.shape[1] == 1:
            return fast_matvec_2d(a, b, out)
        return fast_small_matmul(a, b, out)
    if a.ndim + b.ndim == 3:
        return fast_matvec(a, b, out)
    return fast_batched(a, b, out)


def fast_small_matmul(a, b, out):
    """``a @ b`` for small C-contiguous 2-D operands whose shape has been seen: the
    shortest path there is, a call costing more than their arithmetic.  ``out``: None,
    or a C-contiguous writeable ndarray of the result's shape and dtype (one sharing
    memory with an operand is handled in the jitted call: ``np.may_share_memory``
    costs more than a 16x16 product).  None for any other operands or ``out`` (other
    dtypes, shapes and layouts find no entry)."""
    m, k = a.shape
    n = b.shape[1]
    call = SMALL_CALLS.get((a.dtype, b.dtype, m, n, k))
    if (call is None or k != b.shape[0] or m < 2 or k < 1
            or not (a.flags.c_contiguous and b.flags.c_contiguous)
            or not small_call_shape(a.dtype, m, n, k)):
        return None
    if out is None:
        out = np.empty((m, n), a.dtype)
    elif not (type(out) is np.ndarray and out.dtype == a.dtype and out.shape == (m, n)
              and out.flags.c_contiguous and out.flags.writeable):
        return None
    if not call[0](a, b, out, call[1]):      # strides that are not strictly C's, or misaligned
        return None
    record_tiny(call, a, b, out, one_thread_flops)
    return out


def fast_matvec(a, b, out):
    """``A @ x`` or ``x @ A`` for a C-contiguous 2-D float ``A`` and a contiguous 1-D
    ``x`` of the same dtype (and an ``out`` of that layout sharing no memory with
    them): the matrix-vector product without the general path's broadcasting, whose
    checks cost a small product as much as its arithmetic.  None for anything else,
    which then takes the general path (and gets its errors)."""
    vec_first = a.ndim == 1
    mat, vec = (b, a) if vec_first else (a, b)
    if not (a.dtype == b.dtype and a.dtype in FLOAT_DTYPES and mat.size
            and mat.flags.c_contiguous and vec.flags.c_contiguous
            and vec.shape[0] == mat.shape[0 if vec_first else 1]):
        return None
    rows = mat.shape[1 if vec_first else 0]
    if out is None:
        out = np.empty(rows, a.dtype)
    elif not (type(out) is np.ndarray and out.dtype == a.dtype and out.shape == (rows,)
              and out.flags.c_contiguous and out.flags.writeable and not overlaps(out, a, b)):
        return None
    return matvec_into(mat, vec, out, vec_first)


def fast_matvec_2d(a, b, out):
    """``a @ b`` for 2-D operands of one row (``a``) or one column (``b``) on
    :func:`fast_matvec`, as the matrix-vector product it is (the general path plans a
    GEMM around it, three times the cost of a 256 x 256 product's arithmetic).  None
    where :func:`fast_matvec` has none, or for an ``out`` that is not a C-contiguous
    ndarray of the result's shape."""
    m, n = a.shape[0], b.shape[1]
    if out is not None and not (type(out) is np.ndarray and out.shape == (m, n)
                                and out.flags.c_contiguous):
        return None
    flat_out = None if out is None else out.reshape(-1)
    if m == 1 and a.flags.c_contiguous:
        y = fast_matvec(a.reshape(-1), b, flat_out)
    elif n == 1 and b.flags.c_contiguous:
        y = fast_matvec(a, b.reshape(-1), flat_out)
    else:
        return None
    if y is None:
        return None
    return y.reshape(m, n) if out is None else out


def _batched(a, b, c, batch):
    """C[i] = A[i] @ B[i] over broadcast batch indices."""
    if not batch:
        gemm_into(a, b, c)
        return
    m, k = a.shape[-2:]
    if b.ndim == 2 and c.flags.c_contiguous:
        # One B for every batch: the batch folds into the rows of a single GEMM.
        # Explicit row counts: reshape(-1, 0) is ambiguous when k or n is 0.
        rows = math.prod(batch) * m
        a_full = np.broadcast_to(a, batch + (m, k))
        gemm_into(a_full.reshape(rows, k), b, c.reshape(rows, c.shape[-1]))
        return
    item = c.itemsize
    if c.strides[-1] == item and all(st % item == 0 for st in c.strides):
        batched_into(a, b, c)           # the whole batch in one launch
        return
    tmp = np.empty(c.shape, c.dtype)    # C's rows are not contiguous: compute apart
    batched_into(a, b, tmp)
    c[...] = tmp


def gemm(a, b, c=None, *, alpha=1.0, beta=0.0, trans_a=False, trans_b=False):
    """BLAS GEMM: ``C = alpha * op(A) @ op(B) + beta * C``.

    Parameters
    ----------
    a, b : ndarray, 2-D, float32 or float64
        ``op(X)`` is ``X.T`` when ``trans_x`` is true.  Any strides.
    c : ndarray, optional
        2-D, shape ``(m, n)``, dtype equal to the result dtype (float64 if either
        input is float64), writeable.  Updated in place and returned.  When ``c``
        is omitted a new array is returned and ``beta`` is ignored.
    alpha, beta : float
        ``beta == 0`` never reads ``c``, so NaN or garbage in ``c`` is overwritten.
    trans_a, trans_b : bool
        Must be real booleans (``'N'``/``'T'`` strings raise ``TypeError``).

    Returns
    -------
    ndarray
        ``c``, or a new array.

    Raises
    ------
    TypeError
        Non-float inputs, masked arrays, non-real alpha/beta, non-bool trans flags,
        ``c`` of the wrong dtype.
    ValueError
        Non-2-D operands, mismatched shapes, read-only ``c``, alpha/beta too large
        for the dtype.
    """
    if (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == b.ndim == 2
            and (c is None or type(c) is np.ndarray) and trans_a is False and trans_b is False
            and type(alpha) is float and alpha == 1.0 and type(beta) is float and beta == 0.0):
        # gemm with the defaults is a @ b (into c): matmul's short paths, whose checks
        # are their own (anything they do not take gets gemm's full ones below).
        r = _short_path(a, b, c)
        if r is not None:
            return r
    if any_tensor(a, b, c):
        r = gemm(numpy_view(a, "a", "gemm"), numpy_view(b, "b", "gemm"),
                 numpy_view(c, "c", "gemm", written=True), alpha=alpha, beta=beta, trans_a=trans_a,
                 trans_b=trans_b)
        return c if c is not None else to_tensor(r)
    a = plain_float_array(a, "a", "gemm")
    b = plain_float_array(b, "b", "gemm")
    dtype = _result_dtype(a, b)
    alpha = real_scalar(alpha, "alpha", "gemm", dtype)
    beta = real_scalar(beta, "beta", "gemm", dtype)
    trans_a = check_flag(trans_a, "trans_a", "gemm")
    trans_b = check_flag(trans_b, "trans_b", "gemm")
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"gemm: a and b must be 2-D, got shapes {a.shape} and {b.shape}")
    op_a = a.T if trans_a else a
    op_b = b.T if trans_b else b
    if op_a.shape[1] != op_b.shape[0]:
        raise ValueError(f"gemm: op(a) has shape {op_a.shape} and op(b) has shape {op_b.shape}; "
                         f"inner dimensions {op_a.shape[1]} and {op_b.shape[0]} differ")
    shape = (op_a.shape[0], op_b.shape[1])
    if c is None:
        c = dest = np.empty(shape, dtype)
        beta = 0.0
    else:
        dest = check_out(c, shape, dtype, "gemm", name="c")
    op_a = op_a.astype(dtype, copy=False)
    op_b = op_b.astype(dtype, copy=False)
    overlap = overlaps(dest, a, b)
    if (alpha == 1.0 and beta == 0.0 and not overlap and op_a.flags.c_contiguous
            and op_b.flags.c_contiguous and dest.flags.c_contiguous
            and small_product(op_a, op_b)):
        # matmul's one-call path: a small product's time is mostly the general
        # entry's path planning (64^3 float32: 12 against 26 us on a Zen 3).
        matmul_small(op_a, op_b, dest)
        return c
    if overlap:
        tmp = np.array(dest, order="C") if beta != 0 else np.empty(shape, dtype)
        gemm_into(op_a, op_b, tmp, alpha, beta)
        dest[...] = tmp
    else:
        gemm_into(op_a, op_b, dest, alpha, beta)
    return c
