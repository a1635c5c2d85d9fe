"""CPU, ISA and cache detection; block sizes; nominal and measured peak.

* :func:`detect` -> :class:`Machine`: per-core caches, ISA, vector width and registers.
* :func:`blocking` -> :class:`Blocking`: MR, NR, KC, MC, NC for a dtype, and where each came from.
* :func:`nominal_peak_gflops`, :func:`measured_peak_gflops`: the peaks reports compare against.
"""
from tilegemm.tuning.blocking import Blocking, blocking
from tilegemm.tuning.machine import Machine, detect
from tilegemm.tuning.peak import measured_peak_gflops, nominal_peak_gflops

__all__ = ["Blocking", "Machine", "blocking", "detect", "measured_peak_gflops",
           "nominal_peak_gflops"]
