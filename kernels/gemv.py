"""Matrix-vector products for GEMMs with m == 1 or n == 1.

Packing would copy the whole matrix to use one row or column of each tile, so
these shapes bypass the engine: ``y = alpha * M @ x + beta * y`` streams ``M``
once, in whichever order its strides make contiguous.
"""
import numba
import numpy as np

from tilegemm.config import JIT
from tilegemm.kernels.generator import EPI_BIAS_COL, EPI_BIAS_ROW, EPI_RELU, EPI_RELU6


@numba.njit(**JIT)
def apply_epilogue(x, bias, bias_idx, epi):
    """Bias and activation on one value (scalar twin of the micro-kernel epilogue)."""
    if epi & (EPI_BIAS_ROW | EPI_BIAS_COL):
        x += bias[bias_idx]
    if epi & (EPI_RELU | EPI_RELU6) and x < 0:
        x = 0
    if epi & EPI_RELU6 and x > 6:
        x = 6
    return x


@numba.njit(**JIT)
def _dot_rows(rows, k, m, m_off, m_rs, x, x_off, acc):
    """acc[i] = M[i, :] . x for rows-contiguous M and contiguous x (vectorised reductions).

    Four rows at a time so each load of x feeds four products.
    """
    i = 0
    while i + 4 <= rows:
        r0 = m_off + i * m_rs
        s0 = s1 = s2 = s3 = acc.dtype.type(0)
        for p in range(k):
            xp = x[x_off + p]
            s0 += m[r0 + p] * xp
            s1 += m[r0 + m_rs + p] * xp
            s2 += m[r0 + 2 * m_rs + p] * xp
            s3 += m[r0 + 3 * m_rs + p] * xp
        acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = s0, s1, s2, s3
        i += 4
    for r in range(i, rows):
        base = m_off + r * m_rs
        s = acc.dtype.type(0)
        for p in range(k):
            s += m[base + p] * x[x_off + p]
        acc[r] = s


@numba.njit(**JIT)
def _axpy_columns(rows, k, m, m_off, m_cs, x, x_off, x_s, acc):
    """acc = M @ x for columns-contiguous M: whole columns added, four per pass over acc."""
    for i in range(rows):
        acc[i] = 0
    p = 0
    while p + 4 <= k:
        c0 = m_off + p * m_cs
        x0 = x[x_off + p * x_s]
        x1 = x[x_off + (p + 1) * x_s]
        x2 = x[x_off + (p + 2) * x_s]
        x3 = x[x_off + (p + 3) * x_s]
        for i in range(rows):
            acc[i] += (m[c0 + i] * x0 + m[c0 + m_cs + i] * x1) + (m[c0 + 2 * m_cs + i] * x2
                                                              + m[c0 + 3 * m_cs + i] * x3)
        p += 4
    for q in range(p, k):
        base = m_off + q * m_cs
        xq = x[x_off + q * x_s]
        for i in range(rows):
            acc[i] += m[base + i] * xq


@numba.njit(**JIT)
def gemv(rows, k, alpha, m, m_off, m_rs, m_cs, x, x_off, x_s, beta, y, y_off, y_s,
         bias, bias_row, epi, acc):
    """``y = alpha * M @ x + beta * y`` with M ``rows x k`` and an optional epilogue.

    ``bias_row`` says whether the bias is indexed by the row of y (else it has one
    value, at index 0 -- the other GEMM dimension is 1).  ``acc`` holds ``rows``
    elements of scratch.  Reads y only when ``beta != 0``.
    """
    if m_cs == 1 and x_s == 1:
        _dot_rows(rows, k, m, m_off, m_rs, x, x_off, acc)
    elif m_rs == 1 and rows > 1:
        _axpy_columns(rows, k, m, m_off, m_cs, x, x_off, x_s, acc)
    else:
        # Neither layout is contiguous: plain strided dot products.
        for i in range(rows):
            s = acc.dtype.type(0)
            base = m_off + i * m_rs
            for p in range(k):
                s += m[base + p * m_cs] * x[x_off + p * x_s]
            acc[i] = s
    for i in range(rows):
        v = alpha * acc[i]
        if beta != 0:
            v += beta * y[y_off + i * y_s]
        y[y_off + i * y_s] = apply_epilogue(v, bias, i if bias_row else 0, epi)
