"""tilegemm: GEMM and convolution from Numba vector-IR micro-kernels over packed panels.

Public API: :func:`matmul` (numpy semantics), :func:`gemm` (BLAS semantics),
:func:`conv2d` (torch.nn.functional.conv2d semantics), :class:`ConvWeights`
(weights prepared once for many calls), :func:`conv_plan` (what
``algorithm="auto"`` picks) and :func:`fold_batchnorm`.  Machine facts, block
sizes and the nominal peak live in :mod:`tilegemm.tuning`, the measured peak in
:mod:`tilegemm.kernels.peak`.
"""
from tilegemm.api import gemm, matmul
from tilegemm.conv import ConvWeights, conv2d, conv_plan, fold_batchnorm

__all__ = ["gemm", "matmul", "conv2d", "ConvWeights", "conv_plan", "fold_batchnorm"]
__version__ = "0.1.0"
