"""CPU, ISA and cache detection; block sizes; the nominal peak.

* :func:`detect` -> :class:`Machine`: per-core caches, ISA, vector width and registers.
* :func:`blocking` -> :class:`Blocking`: MR, NR, KC, MC, NC for a dtype, and where each came from.
* :func:`nominal_peak_gflops`: the spec-sheet peak (the measured one is
  :func:`tilegemm.kernels.peak.measured_peak_gflops`).
"""
from tilegemm.tuning.blocking import Blocking, blocking
from tilegemm.tuning.machine import Machine, detect
from tilegemm.tuning.peak import nominal_peak_gflops

__all__ = ["Blocking", "Machine", "blocking", "detect", "nominal_peak_gflops"]
