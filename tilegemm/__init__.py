"""tilegemm: GEMM and convolution from Numba vector-IR micro-kernels over packed panels.

Public API: :func:`matmul` (numpy semantics), :func:`gemm` (BLAS semantics),
:func:`conv2d` (torch.nn.functional.conv2d semantics), :class:`ConvWeights`
(weights prepared once for many calls), :func:`conv_plan` (what
``algorithm="auto"`` picks) and :func:`fold_batchnorm`; quantized arithmetic:
:func:`quantize`, :func:`dequantize`, :func:`qmatmul` (exact int8 products),
:func:`qconv2d` and :class:`QConvWeights`; networks: :func:`load_onnx` (an ONNX
model as a :class:`Network`); threads:
:func:`set_num_threads`, :func:`get_num_threads`, :func:`thread_limit` (and
threadpoolctl's ``threadpool_limits``, see :mod:`tilegemm.threadpool`).  Machine facts, block
sizes and the nominal peak live in :mod:`tilegemm.tuning`, the measured peak in
:mod:`tilegemm.kernels.peak`.  :mod:`tilegemm.dask` (optional, never imported here)
makes these the block kernels of dask arrays.
"""
from tilegemm import threadpool
from tilegemm.api import gemm, matmul
from tilegemm.conv import ConvWeights, conv2d, conv_plan, fold_batchnorm
from tilegemm.ground.threads import get_num_threads, set_num_threads, thread_limit
from tilegemm.net import Network, load_onnx
from tilegemm.conv.qconv import QConvWeights, qconv2d
from tilegemm.conv.quant import dequantize, qmatmul, quantize

__all__ = ["gemm", "matmul", "conv2d", "ConvWeights", "conv_plan", "fold_batchnorm",
           "quantize", "dequantize", "qmatmul", "qconv2d", "QConvWeights", "load_onnx", "Network",
           "get_num_threads", "set_num_threads", "thread_limit"]
__version__ = "0.2.0"

threadpool.register(__version__)
