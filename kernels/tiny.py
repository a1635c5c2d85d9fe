"""The compiled entry points of small one-thread products, for ``tilegemm.matmul``'s
shortest path.

A Numba dispatcher matches a call's argument types against its compiled versions
before it runs one; for a 4x4 product that took 0.6 of the call's 1.1 us.  A small
product that ran on the one-call path (``kernels.small.matmul_small``, or ``matmul``'s
lookup of it by shape) and that runs on one thread whatever the thread count is
recorded here with the compiled entry point of its kernel's ``matmul_small``
(``kernels/_tile.py``) typed for arrays of any layout: ``matmul`` calls that entry
directly for operands of the same shapes and dtype (by identity), and the entry checks
the operands' layout itself, in less time than Python reads an array's flags.
"""
import numba
import numpy as np
from numba import types

#: ``(a.shape, b.shape, a.itemsize) -> (entry, dtype, c's shape, plan)``: the small
#: products that ran on their one-call path and run on one thread whatever the thread
#: count (up to the caller's limit, at least :data:`TINY_FLOPS`); ``entry(a, b, c,
#: plan)`` is ``matmul_small``'s (or ``matmul_small_packed``'s) compiled entry point for 2-D operands of ``dtype`` of
#: any layout, False where they are not C-contiguous and aligned or ``c`` has another
#: shape (it reads the arrays as the types it was compiled for: the caller checks
#: that they are ndarrays of ``dtype``, 2-D, and ``c`` writeable).  The key is the
#: shapes and the item size (float32 and float64 products of one shape each have
#: theirs), the dtypes checked by identity: a key with the dtypes had cost 0.8 us.
TINY_CALLS = {}
#: (a's dtype, b's dtype, m, n, k) -> ``kernels.small.small_call``'s ``(entry,
#: plan)``, filled by ``tilegemm.matmul`` on the first small product of each shape:
#: later ones skip its general checks.  Cleared with the kernel choices (``driver.reset_plans``).
SMALL_CALLS = {}
#: ``a.shape + b.shape + (itemsize,)`` -> ``kernels.batched.OneCallBatch`` (or False
#: where the one-call batch does not apply): the batches ``tilegemm.matmul`` has
#: planned.  Cleared with the kernel choices.
BATCH_CALLS = {}
#: Keys (as of ``TINY_CALLS``) whose products exceed the caller's limit: not asked again
#: (the limit costs a microsecond to work out).  Cleared with ``TINY_CALLS``.
TINY_DECLINED = set()
#: Products (2·m·n·k flops) up to this size run on one thread whatever the thread
#: count and the sharing rule (``kernels.small.NEVER_SHARED_FLOPS`` is this limit).
TINY_FLOPS = 2 * 32 ** 3


def entry_for(dispatcher, dtype, plan):
    """The compiled entry point of ``dispatcher`` (a kernel module's ``matmul_small``
    or ``matmul_small_packed``) for 2-D operands of ``dtype`` of any layout and a
    plan of ``plan``'s type, compiled on first use: the one version every call of
    the kernel runs (the dispatcher would compile one more per layout it is called
    with, a second of a second of compiling per kernel)."""
    operand = types.Array(numba.from_dtype(dtype), 2, "A")
    sig = (operand, operand, operand, numba.typeof(plan))
    if sig not in dispatcher.overloads:
        dispatcher.compile(sig)
    return dispatcher.overloads[sig].entry_point


def record_tiny(call, a, b, c, limit):
    """Keep in ``TINY_CALLS`` the entry point ``call = (entry, plan)`` of the product
    that just ran (``kernels.small.small_call``, :func:`entry_for`), when a, b and c
    have one dtype and the product has at most ``limit(c.dtype)`` flops (the caller's
    bound of products that never take a second thread); once per key."""
    key = (a.shape, b.shape, a.itemsize)
    if key in TINY_CALLS or key in TINY_DECLINED:
        return
    if not (a.dtype == b.dtype == c.dtype and a.ndim == b.ndim == c.ndim == 2):
        return
    if 2 * a.shape[0] * a.shape[1] * c.shape[1] > limit(c.dtype):
        TINY_DECLINED.add(key)
        return
    # The canonical dtype object: matmul compares dtypes by identity.
    TINY_CALLS[key] = (call[0], np.dtype(c.dtype.char), c.shape, call[1])
