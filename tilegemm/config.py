"""JIT options shared by every Numba function in tilegemm.

Fast-math is opted into flag by flag. ``nnan`` and ``ninf`` are deliberately
absent: with them LLVM may assume no NaN/Inf exists and NaN would stop
propagating the way it does in numpy.  ``contract`` lets a*b+c fuse into an
FMA, ``reassoc`` lets reductions be vectorised.
"""
import os

#: Fast-math flags applied to jitted loops (never nnan / ninf).
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}

#: Disable Numba's on-disk cache with TILEGEMM_NO_CACHE=1 (useful when timing compiles).
CACHE = os.environ.get("TILEGEMM_NO_CACHE", "0") != "1"

#: Options for serial jitted functions.
JIT = dict(nogil=True, cache=CACHE, fastmath=FASTMATH)
