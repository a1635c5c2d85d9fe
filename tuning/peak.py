"""Nominal peak: threads x clock x FMA units x vector lanes x 2 flops, from the detected CPU.

The measured peak (an FMA-throughput loop) is :mod:`tilegemm.kernels.peak`: it is a
kernel, built with the same IR toolkit as the micro-kernels.
"""
import numpy as np

from tilegemm.tuning.machine import detect


def lanes_for(dtype):
    """Elements of ``dtype`` in one vector register of the detected ISA."""
    return detect().vector_bits // (8 * np.dtype(dtype).itemsize)


def nominal_peak_gflops(dtype=np.float32, threads=1):
    """Spec-sheet peak: threads x clock x FMA units x lanes x 2 flops."""
    m = detect()
    return threads * m.clock_hz * m.fma_units * lanes_for(dtype) * 2 / 1e9
