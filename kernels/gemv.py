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
def gemv(rows, k, alpha, m, m_off, m_rs, m_cs, x, x_off, x_s, beta, y, y_off, y_s,
         bias, bias_row, epi, acc):
    """``y = alpha * M @ x + beta * y`` with M ``rows x k`` and an optional epilogue.

    ``bias_row`` says whether the bias is indexed by the row of y (else it has one
    value, at index 0 -- the other GEMM dimension is 1).  ``acc`` holds ``rows``
    elements of scratch.  Reads y only when ``beta != 0``.
    """
    if m_cs == 1 or m_rs != 1:
        # Rows contiguous (or neither): one dot product per row.
        for i in range(rows):
            s = acc.dtype.type(0)
            base = m_off + i * m_rs
            for p in range(k):
                s += m[base + p * m_cs] * x[x_off + p * x_s]
            acc[i] = s
    else:
        # Columns contiguous: accumulate whole columns, unit stride in the inner loop.
        for i in range(rows):
            acc[i] = 0
        for p in range(k):
            xp = x[x_off + p * x_s]
            base = m_off + p * m_cs
            for i in range(rows):
                acc[i] += m[base + i] * xp
    for i in range(rows):
        v = alpha * acc[i]
        if beta != 0:
            v += beta * y[y_off + i * y_s]
        y[y_off + i * y_s] = apply_epilogue(v, bias, i if bias_row else 0, epi)
