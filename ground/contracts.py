"""Contracts shared by every component: JIT options, epilogue codes, integer helpers.

Fast-math is opted into flag by flag. ``nnan`` and ``ninf`` are deliberately
absent: with them LLVM may assume no NaN/Inf exists and NaN would stop
propagating the way it does in numpy.  ``contract`` lets a*b+c fuse into an
FMA, ``reassoc`` lets reductions be vectorised.
"""
import os

from numba.extending import overload

#: Fast-math flags applied to jitted loops (never nnan / ninf).
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}

#: Disable Numba's on-disk cache with TILEGEMM_NO_CACHE=1 (useful when timing compiles).
CACHE = os.environ.get("TILEGEMM_NO_CACHE", "0") != "1"

#: Options for serial jitted functions.
JIT = dict(nogil=True, cache=CACHE, fastmath=FASTMATH)

# Fused epilogue codes, OR-ed into one ``epi`` integer: the micro-kernels, the
# packers' output transforms and the direct kernels all read the same bits.
#: Add ``bias[row]`` (one value per output row, e.g. a conv's output channel in NCHW).
EPI_BIAS_ROW = 1
#: Add ``bias[col]`` (one value per output column, e.g. NHWC or ``gemm(bias=...)``).
EPI_BIAS_COL = 2
#: Then clamp below at zero.
EPI_RELU = 4
#: Then clamp to [0, 6].
EPI_RELU6 = 8


def cdiv(a, b):
    """Ceiling of ``a / b`` for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_up(a, m):
    """``a`` rounded up to a multiple of ``m`` (``m`` > 0)."""
    return -(-a // m) * m


# The same two functions inside jitted code (plain Python calls stay dispatcher-free).
@overload(cdiv, inline="always")
def _cdiv_jit(a, b):
    return lambda a, b: -(-a // b)


@overload(round_up, inline="always")
def _round_up_jit(a, m):
    return lambda a, m: -(-a // m) * m
