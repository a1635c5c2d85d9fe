"""tilegemm: GEMM and convolution from Numba vector-IR micro-kernels over packed panels.

Public API: :func:`matmul` (numpy semantics) and :func:`gemm` (BLAS semantics).
Machine facts, block sizes and peak live in :mod:`tilegemm.tuning`.
"""
from tilegemm.api import gemm, matmul

__all__ = ["gemm", "matmul"]
__version__ = "0.1.0"
