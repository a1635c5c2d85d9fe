"""The worker threads that run the shares of a product beside the calling thread.

A share of a product is one nogil jitted call, a millisecond or so.  A worker
that goes to sleep between two such calls must be woken for the next one, and on
a virtual machine a sleeping vCPU comes back slowly: measured here (2 vCPUs, 2
threads, a pause of 0.15 s before each batch of calls), a Winograd layer ran
4.8-5.1 ms with workers that block between calls and 3.1-3.7 ms with workers
that first spin a little, against 5.1-6.0 ms on one thread.  So each worker, like
OpenMP's and OpenBLAS's, spins on a flag for about ``SPIN_SECONDS`` before it
blocks; the caller spins the same way for the shares it waits on.  Spinning
happens in jitted code without the GIL, on an atomic load with a pause
instruction.

One caller at a time uses the crew.  A second Python thread that calls while the
crew is busy gets its shares run by a ``ThreadPoolExecutor`` instead, so
concurrent calls are never serialised behind each other and never share a
worker.  After a fork the crew is rebuilt (threads do not survive it).
"""
import concurrent.futures
import os
import threading
import time

import llvmlite.ir as ir
import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from tilegemm.config import JIT

#: How long an idle worker (or a waiting caller) spins before it blocks.
SPIN_SECONDS = 0.002


@intrinsic
def _load_acquire(typingctx, flags, i):
    """``flags[i]`` read with acquire ordering: never hoisted out of a spin loop."""
    def emit(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(array.data, [args[1]]), ordering="acquire",
                                   align=8)
    return types.int64(flags, types.intp), emit


@intrinsic
def _pause(typingctx):
    """The x86 spin-wait hint (``pause``): saves power, frees the core's other thread."""
    def emit(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause",
                                              fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), emit


@numba.njit(**JIT)
def spin_until(flags, i, value, iterations):
    """Spin until ``flags[i] == value``, at most ``iterations`` times; whether it got there.

    Assumes ``flags`` is a 1-D int64 array written by other threads.
    """
    for _ in range(iterations):
        if _load_acquire(flags, i) == value:
            return True
        _pause()
    return _load_acquire(flags, i) == value


def _spin_iterations():
    """How many spin_until iterations last about SPIN_SECONDS on this machine."""
    flags = np.zeros(1, np.int64)
    spin_until(flags, 0, 1, 10)              # compile (or load from the cache) first
    t0 = time.perf_counter()
    spin_until(flags, 0, 1, 20000)
    per = max(time.perf_counter() - t0, 1e-6) / 20000
    return max(1000, int(SPIN_SECONDS / per))


class _Worker:
    """One thread running posted jobs: ``flags = [posted, done]`` count them."""

    def __init__(self, spins):
        self.flags = np.zeros(2, np.int64)
        self.cond = threading.Condition()
        self.spins = spins
        self.job = None
        self.error = None
        threading.Thread(target=self._loop, name="tilegemm-crew", daemon=True).start()

    def _loop(self):
        seen = 0
        while True:
            if not spin_until(self.flags, 0, seen + 1, self.spins):
                with self.cond:
                    while self.flags[0] == seen:
                        self.cond.wait()
            seen += 1
            fn, args = self.job
            try:
                fn(*args)
            except BaseException as exc:   # handed to the caller by wait()
                self.error = exc
            with self.cond:
                self.flags[1] = seen
                self.cond.notify_all()

    def post(self, fn, args):
        """Start ``fn(*args)`` on this worker; returns the ticket :meth:`wait` takes."""
        self.job, self.error = (fn, args), None
        with self.cond:
            self.flags[0] += 1
            self.cond.notify_all()
            return int(self.flags[0])

    def wait(self, ticket):
        """Wait for job ``ticket`` to finish; re-raise what it raised."""
        if not spin_until(self.flags, 1, ticket, self.spins):
            with self.cond:
                while self.flags[1] != ticket:
                    self.cond.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


_lock = threading.Lock()
_crew = []
_crew_pid = None
_pool = None
_pool_lock = threading.Lock()


def _fallback():
    """The thread pool for callers that find the crew busy (created once, never replaced)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, numba.config.NUMBA_NUM_THREADS - 1),
                thread_name_prefix="tilegemm")
    return _pool


def run_shares(fn, shares):
    """Run ``fn(*share)`` for every share: the first on this thread, the rest beside it.

    Exceptions raised by any share reach the caller, after every share has ended.
    """
    global _crew, _crew_pid
    if len(shares) == 1:
        fn(*shares[0])
        return
    if not _lock.acquire(blocking=False):
        futures = [_fallback().submit(fn, *share) for share in shares[1:]]
        fn(*shares[0])
        for f in futures:
            f.result()
        return
    try:
        if _crew_pid != os.getpid():
            _crew, _crew_pid = [], os.getpid()
        if len(_crew) < len(shares) - 1:
            spins = _spin_iterations()
            _crew += [_Worker(spins) for _ in range(len(shares) - 1 - len(_crew))]
        tickets = [(worker, worker.post(fn, share)) for worker, share in zip(_crew, shares[1:])]
        try:
            fn(*shares[0])
        finally:
            errors = []
            for worker, ticket in tickets:
                try:
                    worker.wait(ticket)
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]
    finally:
        _lock.release()
