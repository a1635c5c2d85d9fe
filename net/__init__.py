"""Whole networks: ONNX models loaded as a graph, optimized by passes (constant
folding, BatchNorm folding, bias/activation/residual fused into the conv epilogue)
and run on tilegemm's convolutions and products.

:func:`load_onnx` reads a model (with the optional ``onnx`` package) into a
:class:`Network`.
"""
from tilegemm.net.graph import Graph, Node, TensorInfo, from_onnx
from tilegemm.net.network import Network, load_onnx

__all__ = ["load_onnx", "Network", "Graph", "Node", "TensorInfo", "from_onnx"]
