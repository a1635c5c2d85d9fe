"""Convolution on the GEMM engine: implicit im2col, Winograd F(2x2, 3x3) and direct.

:func:`conv2d` is the front door (torch.nn.functional.conv2d semantics),
:class:`ConvWeights` prepares weights once for many calls, :class:`PreparedConv`
binds a layer to one input shape (validated and planned once, as a network runs it),
:func:`conv_plan` shows what ``algorithm="auto"`` chooses and why, and
:func:`fold_batchnorm` folds an inference BatchNorm into the weights.
"""
from tilegemm.conv.api import ConvWeights, PreparedConv, conv2d, fold_batchnorm
from tilegemm.conv.plan import ConvPlan, conv_plan

__all__ = ["conv2d", "ConvWeights", "PreparedConv", "fold_batchnorm", "conv_plan", "ConvPlan"]
