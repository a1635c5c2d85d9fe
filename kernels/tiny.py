"""The compiled entry points of small one-thread products, for ``tilegemm.matmul``'s
shortest path.

A Numba dispatcher matches a call's argument types against its compiled versions
before it runs one; for a 4x4 product that took 0.6 of the call's 1.1 us.  A small
product that ran on the one-call path (``kernels.small.matmul_small``, or ``matmul``'s
lookup of it by shape) and that runs on one thread whatever the thread count is
recorded here with the entry point of the version that ran it, and ``matmul`` calls
that entry directly for operands of the same shapes, dtypes (by identity) and form.
"""
import numba

#: ``a.shape + b.shape + (a.itemsize,) -> (entry, a dtype, b dtype, plan)``: the small
#: products that ran on their one-call path and run on one thread whatever the thread
#: count (up to the caller's limit, at least :data:`TINY_FLOPS`); ``entry(a, b, c,
#: plan)`` is the compiled version's own entry point for C-contiguous, aligned 2-D
#: operands of those dtypes.  The key is the shapes and the item size (float32 and
#: float64 products of one shape each have theirs), the dtypes checked by identity:
#: a key with the dtypes had cost 0.8 us.
TINY_CALLS = {}
#: (a's dtype, b's dtype, m, n, k) -> ``kernels.small.small_call``'s ``(call,
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


def record_tiny(call, a, b, c, limit):
    """Keep in ``TINY_CALLS`` the entry point of ``call = (dispatcher, plan)`` that
    just ran ``dispatcher(a, b, c, plan)``, when the operands are of the form the entry
    is called with (C-contiguous, aligned, writeable: the entry's argument types are
    exactly theirs), the product has at most ``limit(c.dtype)`` flops (the caller's
    bound of products that never take a second thread) and once per key (the checks
    below cost a ``matmul(..., out=)`` that takes the one-call path each time)."""
    key = a.shape + b.shape + (a.itemsize,)
    if key in TINY_CALLS or key in TINY_DECLINED:
        return
    if not all(x.flags.c_contiguous and x.flags.aligned and x.flags.writeable
               for x in (a, b, c)):
        return
    if 2 * a.shape[0] * a.shape[1] * c.shape[1] > limit(c.dtype):
        TINY_DECLINED.add(key)
        return
    dispatcher, plan = call
    sig = tuple(numba.typeof(x) for x in (a, b, c, plan))
    compiled = dispatcher.overloads.get(sig)
    if compiled is not None:
        TINY_CALLS[key] = (compiled.entry_point, a.dtype, b.dtype, plan)
