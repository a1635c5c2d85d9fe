"""Nominal peak: threads x clock x FMA units x vector lanes x 2 flops, from the detected CPU.

The measured peak (an FMA-throughput loop) is :mod:`tilegemm.kernels.peak`: it is a
kernel, built with the same IR toolkit as the micro-kernels.
"""
import numpy as np

from tilegemm.tuning.machine import detect, host_max_clock


def lanes_for(dtype):
    """Elements of ``dtype`` in one vector register of the detected ISA."""
    return detect().vector_bits // (8 * np.dtype(dtype).itemsize)


def nominal_peak_gflops(dtype=np.float32, threads=1, clock="base"):
    """Spec-sheet peak: threads x clock x FMA units x lanes x 2 flops.

    Parameters
    ----------
    clock : {"base", "max"}
        ``"base"``: the nominal clock of :func:`detect` (brand string or
        /proc/cpuinfo).  The library's own thresholds use it and were tuned with
        it: the GEMM driver's ``serial_flops`` (from how many flops a product is
        shared between threads) and the convolution cost model, where only the
        ratios of estimates matter.  ``"max"``: the highest clock known
        (:func:`tilegemm.tuning.machine.max_clock`, the boost clock where cpufreq
        gives it): the figure ``tilegemm info`` sets beside the measured peak, which
        runs at the boost clock and sat above a base-clock "nominal" peak.
    """
    m = detect()
    if clock not in ("base", "max"):
        raise ValueError(f"clock must be 'base' or 'max', got {clock!r}")
    hz = m.clock_hz if clock == "base" else host_max_clock()[0]
    return threads * hz * m.fma_units * lanes_for(dtype) * 2 / 1e9
