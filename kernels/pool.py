"""Worker threads that take a call's shares without a system call on the hot path.

A thread pool built on locks and queues hands each share over by waking a sleeping
thread and, at the end, waking the caller: on this kind of machine each wake-up
costs 15-30 us, ~50 us a call, which is a tenth of a 0.5 ms convolution.  Like
OpenMP runtimes, this pool spins instead: a worker that finishes a share watches
its slot for ``IDLE_SPIN_SECONDS`` before it sleeps, and the caller, once its own
share is done, watches the workers' completion flags.  Both watch in jitted code
that releases the GIL, with atomic loads and the ``pause`` hint.  Calls that
arrive while the pool is busy (other Python threads) get ``None`` from
:func:`acquire` and use the queue-based pool instead, and so does a process's
first threaded call: the spinning pool is created after it, on a thread of its
own (:func:`start_soon`), so that a cold first call does not also wait for the
pool's flag functions to compile.

Every threaded call goes through :func:`run_shares` (a list of shares) or
:func:`launch` (task loops over a shared counter).  Python threads rather than
Numba's parallel machinery keep concurrent calls from several Python threads safe
(no threading-layer constraints) and save seconds of compile time.
"""
import concurrent.futures
import os
import threading
import time

import numba
import numpy as np

from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.workspace import aligned_empty
from tilegemm.kernels import sync
from tilegemm.kernels.native import call_share, run_share

#: How long an idle worker watches its slot before sleeping.  Back-to-back calls (a
#: network's layers, a benchmark loop) come within a few tens of microseconds of the
#: caller's end, but the worker may have finished its share that much earlier again,
#: and waking a sleeping worker costs more than the call it joins (on a VM, an
#: interrupt to a halted virtual CPU: 50-100 us).  At 100 us a loop of 256^3 float32
#: products on a 2-core Zen 3 ran a median 311-332 us a call; at 1 ms 252-270.
IDLE_SPIN_SECONDS = 1e-3
#: How long a caller waits for a worker to take its first task before starting its own
#: share (a worker that slept, or that the system has not scheduled, is not waited for).
GATE_SPIN_SECONDS = 50e-6
#: How long the caller watches for a worker to finish before polling with sleeps: the
#: shares of a call are balanced, so the wait is short unless the machine is busy.
WAIT_SPIN_SECONDS = 2e-3
#: ... then how long it sleeps between looks.
SLEEP_POLL_SECONDS = 100e-6
#: The gate of a call that runs on the caller's thread alone: what its share publishes
#: there tells nobody (see :meth:`SpinPool.run`), and no call allocates one.
NO_GATE = np.zeros(1, np.int64)
#: One flag per 64-byte cache line, so that a worker's flag shares a line with no other.
_STRIDE = 8
#: No flags to publish (see :func:`signal`).
_NONE = np.zeros(0, np.int64)


def _flag_lines(workers):
    """``workers`` flags, one cache line each, in lines of their own: a worker polls its
    flag's line all the while it spins, and any other data in that line (a small array
    malloc put beside it) would cost its writer a transfer of the line back at every
    write."""
    flags = aligned_empty(workers * _STRIDE, np.int64)
    flags[:] = 0
    return flags


@numba.njit(nogil=True, cache=True)
def signal(post, ats, value, watch, at, target, equal, spins):
    """``post[a] = value`` for ``a`` in ``ats``, then whether, within ``spins`` polls,
    ``watch[at] == target`` becomes ``equal``.

    Every flag operation of the pool in one jitted function: a cold process compiles
    one function, not one per operation (a tenth of a second each).  The GIL is free
    all the while (see :meth:`SpinPool.run`).
    """
    for a in ats:
        sync.publish(post, a, value)
    for _ in range(spins):
        if (sync.acquire(watch, at) == target) == equal:
            return True
        sync.pause()
    return False


@numba.njit(nogil=True, cache=True)
def serve(post, done, native, at, last, spins, finished):
    """A worker's loop in jitted code: ``(last, python)`` once a Python share is posted
    (``python`` True) or ``spins`` polls pass with nothing new (False).

    ``finished``: publish ``done[at] = last`` first (the Python share just run).  A
    new number in ``post[at]`` is a share; where ``native[at]`` holds an address it
    is a native share (:mod:`tilegemm.kernels.native`), run here, its completion
    published, and the loop goes on without ever taking the GIL.
    """
    if finished:
        sync.publish(done, at, last)
    while True:
        n = 0
        while sync.acquire(post, at) == last:
            if n == spins:
                return last, False
            sync.pause()
            n += 1
        last = sync.acquire(post, at)
        if native[at] == 0:
            return last, True
        call_share(native[at], native[at + 1])
        sync.publish(done, at, last)


@numba.njit(nogil=True, cache=True)
def post_native(post, native, ats, seq, address, blocks):
    """Hand worker ``i`` (its flags at ``ats[i]``, awake) the native share at
    ``address`` on argument block ``blocks[i + 1]``, and post call ``seq`` to it."""
    for i in range(ats.size):
        at = ats[i]
        native[at] = address
        native[at + 1] = blocks[i + 1]
        sync.publish(post, at, seq)


@numba.njit(nogil=True, cache=True)
def run_and_wait(address, block, done, ats, seq, spins):
    """Run the caller's native share (``block``), then whether every worker (flags at
    ``ats``) finishes call ``seq`` within ``spins`` polls each."""
    call_share(address, block)
    for i in range(ats.size):
        n = 0
        while sync.acquire(done, ats[i]) != seq:
            if n == spins:
                return False
            sync.pause()
            n += 1
    return True


def warm():
    """Compile, or load from Numba's cache, the jitted functions every threaded call
    runs, with the argument types the pool passes them.

    A cold process's tile helper (``kernels/tilebuild.py``) calls this once its
    tiles are built, so that the caller finds them in the cache when its first
    threaded call starts the pool (0.2-0.3 s of compiling on a cold cache).
    """
    flags = np.zeros(_STRIDE, np.int64)
    signal(_NONE, _NONE, 0, flags, 0, 0, False, 0)     # no flags, no polls
    serve(flags, flags, flags, 0, 0, 0, False)          # post[0] == last: back at once
    run_share.compile((numba.int64, numba.int64))       # an address runs nothing here
    rows = np.zeros(2, np.int64)
    post_native(flags, flags, flags[:0], 0, 0, rows)    # no workers: nothing posted
    run_and_wait.compile((numba.int64, numba.int64, numba.int64[::1], numba.int64[::1],
                          numba.int64, numba.int64))


def spin_until(flags, at, value, equal, spins):
    """Whether, within ``spins`` polls, ``flags[at] == value`` becomes ``equal``."""
    return signal(_NONE, _NONE, 0, flags, at, value, equal, spins)


def _spins_per_second():
    """Polls of :func:`spin_until` per second on this machine (measured once).

    The fastest of a few tries: the pool is created on a thread of its own while
    the caller works, and a try the system interrupts would make every spin of the
    pool's life that much shorter (a worker that sleeps at once, a caller that
    polls with sleeps)."""
    flags = np.zeros(1, np.int64)
    spin_until(flags, 0, 1, True, 10)            # compile (or load) first
    n, best = 20000, float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        spin_until(flags, 0, 1, True, n)
        best = min(best, time.perf_counter() - t0)
    return n / max(best, 1e-6)


class SpinPool:
    """``workers`` daemon threads, each with one slot for a share of the current call.

    A call (:meth:`run`) numbers itself with ``seq``, fills the slots, publishes
    ``seq`` in each worker's ``post`` flag and runs the first share itself; each
    worker runs its share and publishes ``seq`` in its ``done`` flag.  A flag is
    written by one side only (``post`` by the caller, ``done`` by its worker), after
    the data it announces.

    No thread ever waits for the GIL, which would put it to sleep: flags are
    published from jitted code that has let go of the GIL, and the caller starts its
    own share only once a worker has taken a task (``gate``) and so is in jitted code
    too.  A worker that slept (idle past ``IDLE_SPIN_SECONDS``) is woken through the
    ``posted`` condition instead.
    """

    def __init__(self, workers):
        self.workers = workers
        self.busy = threading.Lock()
        self.seq = 0
        self.post = _flag_lines(workers)
        self.done = _flag_lines(workers)
        # Per worker: a native share's function and block addresses, 0 for a Python share.
        self.native = _flag_lines(workers)
        self.jobs = [None] * workers
        self.errors = [None] * workers
        self.sleeping = [False] * workers
        self.posted = threading.Condition()
        self.open_gate = np.ones(1, np.int64)
        self.flag_at = np.arange(workers, dtype=np.int64) * _STRIDE
        self.first_at = self.flag_at[:1]         # (the two-thread call's, made once)
        rate = _spins_per_second()
        self.idle_spins = max(1, int(IDLE_SPIN_SECONDS * rate))
        self.gate_spins = max(1, int(GATE_SPIN_SECONDS * rate))
        self.wait_spins = max(1, int(WAIT_SPIN_SECONDS * rate))
        for w in range(workers):
            threading.Thread(target=self._work, args=(w,), name=f"tilegemm-{w}",
                             daemon=True).start()

    def _work(self, w):
        at, last, finished = w * _STRIDE, 0, False
        while True:
            last, python = serve(self.post, self.done, self.native, at, last, self.idle_spins,
                                 finished)
            finished = python
            if not python:
                with self.posted:
                    self.sleeping[w] = True
                    # A call that needs fewer workers skips this one: any new number.
                    while self.post[at] == last:
                        self.posted.wait()
                    self.sleeping[w] = False
                continue                  # serve() takes the share just posted
            fn, args = self.jobs[w]
            self.jobs[w] = None
            try:
                fn(*args)
            except BaseException as exc:         # re-raised on the calling thread
                self.errors[w] = exc

    def run(self, fn, shares, gate=None):
        """``fn(*share)`` for every share, the first on this thread.

        The caller must hold ``busy`` and pass at most ``workers + 1`` shares.
        ``gate``: an int64 array whose element 0 leaves 0 once a share is under way
        in jitted code (the task counter of ``next_task`` loops); without it the
        caller starts at once.
        """
        rest = shares[1:]
        for w, share in enumerate(rest):
            self.jobs[w] = (fn, share)
            self.native[w * _STRIDE] = 0
        seq = self._post(len(rest), gate)
        try:
            fn(*shares[0])
        finally:
            self._wait(len(rest), seq)   # they use the caller's buffers: even on an error
        for w in range(len(rest)):
            exc, self.errors[w] = self.errors[w], None
            if exc is not None:
                raise exc

    def run_native(self, address, blocks):
        """The native share at ``address`` on every argument block (``blocks``: their
        addresses, an int64 array), the first on this thread; as :meth:`run`
        otherwise.  No thread takes the GIL.

        With every worker it needs awake (spinning), posting, the caller's share and
        the wait for the workers are two jitted calls (:func:`post_native`,
        :func:`run_and_wait`): posted flag by flag from Python they cost 5 us, more
        than a small product's share.
        """
        count = len(blocks) - 1
        ats = self.flag_at[:count] if count != 1 else self.first_at
        with self.posted:
            # Under the lock: a worker going to sleep sees this post first.
            awake = True not in self.sleeping[:count]
            if awake:
                self.seq += 1
                seq = self.seq
                post_native(self.post, self.native, ats, seq, address, blocks)
        if not awake:
            self._run_native_waking(address, blocks)
            return
        finished = False
        try:
            finished = run_and_wait(address, blocks[0], self.done, ats, seq, self.wait_spins)
        finally:   # they use the caller's buffers: even on an interrupt
            if not finished:
                self._wait(count, seq)

    def _run_native_waking(self, address, blocks):
        """:meth:`run_native` where a worker it needs sleeps (woken through ``posted``)."""
        rest = blocks[1:]
        for w, block in enumerate(rest):
            self.native[w * _STRIDE] = address
            self.native[w * _STRIDE + 1] = block
        seq = self._post(len(rest), None)
        try:
            run_share(address, blocks[0])
        finally:
            self._wait(len(rest), seq)

    def _post(self, count, gate):
        """Post a new call number to the first ``count`` workers; returns the number."""
        self.seq += 1
        seq = self.seq
        with self.posted:
            awake = self.flag_at[:count]
            if any(self.sleeping[:count]):
                for w in range(count):
                    if self.sleeping[w]:
                        self.post[w * _STRIDE] = seq
                self.posted.notify_all()
                awake = awake[[not asleep for asleep in self.sleeping[:count]]]
            # Under the lock: a worker going to sleep sees this post first.
            # Post to the awake workers, then watch the gate until one has begun.
            signal(self.post, awake, seq, self.open_gate if gate is None or not awake.size
                   else gate, 0, 0, False, self.gate_spins)
        return seq

    def _wait(self, count, seq):
        """Until the first ``count`` workers have finished call ``seq``."""
        for w in range(count):
            at = w * _STRIDE
            if not spin_until(self.done, at, seq, True, self.wait_spins):
                while self.done[at] != seq:
                    time.sleep(SLEEP_POLL_SECONDS)


_pool = None
_pool_pid = None
_create_lock = threading.Lock()
_creating = []  # the thread creating this process's pool, while it runs


def acquire(needed):
    """The spinning pool, held for this call, or ``None`` when it does not exist yet,
    another call holds it, or it has fewer than ``needed`` workers.

    Release with ``pool.busy.release()``.  A call that gets ``None`` runs on the
    queue-based :func:`executor` and then calls :func:`start_soon`.
    """
    spinning = _pool if _pool_pid == os.getpid() else None
    if spinning is None or spinning.workers < needed or not spinning.busy.acquire(blocking=False):
        return None
    return spinning


def start(needed=1):
    """Create this process's spinning pool now, if it has none (one worker for every
    thread Numba could be asked for beyond the caller's, ``needed`` at least)."""
    global _pool, _pool_pid
    with _create_lock:
        if _pool is None or _pool_pid != os.getpid():
            # A forked child has none of its parent's threads: a pool of its own.
            workers = max(needed, numba.config.NUMBA_NUM_THREADS - 1, 1)
            _pool, _pool_pid = SpinPool(workers), os.getpid()


def start_soon(needed):
    """Create the spinning pool on a thread of its own, once, unless it exists.

    Creating it compiles, or loads, its jitted flag functions; on a cold cache
    that is a quarter of a second which a process's first threaded call, already
    compiling its own loops, does not wait for: that call runs on the queue-based
    pool, and the calls after it find the spinning pool ready.
    """
    with _create_lock:
        if (_pool is not None and _pool_pid == os.getpid()) or _creating:
            return
        thread = threading.Thread(target=_create, args=(needed,), name="tilegemm-pool-start")
        _creating.append(thread)
    thread.start()


def _create(needed):
    try:
        start(needed)
    finally:
        with _create_lock:
            _creating.clear()


def _finish_creation():
    """Before a fork: no thread may be compiling the pool's functions (the child would
    inherit the compiler's lock held by a thread it does not have)."""
    for thread in list(_creating):
        thread.join()


def _reset_after_fork():
    """In a forked child: a lock another parent thread held at the fork stays held."""
    global _create_lock
    _create_lock = threading.Lock()
    _creating.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_finish_creation, after_in_child=_reset_after_fork)


_queue_pool = None
_queue_pool_pid = None
_queue_pool_lock = threading.Lock()


def executor():
    """The process-wide queue-based pool, for calls that find the spinning pool busy
    or not created yet.

    Created once per process, with as many workers as Numba could ever be asked for
    minus one (the calling thread takes a share itself); workers start only when
    used.  It is never replaced within a process, so a caller can never be handed a
    pool another thread shut; a forked child, which has none of its parent's
    threads, makes its own.
    """
    global _queue_pool, _queue_pool_pid
    if _queue_pool is None or _queue_pool_pid != os.getpid():
        with _queue_pool_lock:
            if _queue_pool is None or _queue_pool_pid != os.getpid():
                _queue_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(1, numba.config.NUMBA_NUM_THREADS - 1),
                    thread_name_prefix="tilegemm")
                _queue_pool_pid = os.getpid()
    return _queue_pool


def run_shares(fn, shares, gate=None):
    """Run ``fn(*share)`` for every share: the first on this thread, the rest on pool threads.

    The spinning pool takes them when it is free; a call that finds it busy (another
    Python thread's) uses the queue-based :func:`executor`.  ``gate``: the shares'
    task counter, if they take tasks from one (see ``SpinPool.run``).
    """
    spinning = acquire(len(shares) - 1) if len(shares) > 1 else None
    if spinning is not None:
        try:
            return spinning.run(fn, shares, gate)
        finally:
            spinning.busy.release()
    futures = [executor().submit(fn, *share) for share in shares[1:]]
    fn(*shares[0])
    for f in futures:
        f.result()
    if len(shares) > 1:
        start_soon(len(shares) - 1)


def run_native_shares(address, blocks):
    """Run the native share at ``address`` (:mod:`tilegemm.kernels.native`) on every
    argument block in ``blocks`` (their addresses): the first on this thread, the
    rest on pool threads that never take the GIL.  A call that finds the spinning
    pool busy runs them on the queue-based :func:`executor` instead."""
    spinning = acquire(len(blocks) - 1) if len(blocks) > 1 else None
    if spinning is not None:
        try:
            return spinning.run_native(address, blocks)
        finally:
            spinning.busy.release()
    futures = [executor().submit(run_share, address, block) for block in blocks[1:]]
    run_share(address, blocks[0])
    for f in futures:
        f.result()
    if len(blocks) > 1:
        start_soon(len(blocks) - 1)


def launch(run, threads):
    """``run(t, counter)`` for ``t`` in ``range(threads)``, each on its own Python thread.

    ``counter`` is a fresh one-element int64 array from which the jitted task loops
    take their tasks (see ``next_task``), so a thread the machine slows down takes
    fewer.  The task loops release the GIL, so the threads run in parallel; the
    calling thread takes ``t = 0`` itself.
    """
    counter = np.zeros(1, np.int64)
    if threads <= 1:
        run(0, counter)
        return
    # The counter tells the spinning pool that a worker has begun.
    run_shares(run, [(t, counter) for t in range(threads)], gate=counter)


#: A slice of fewer elements is not worth a share (:func:`for_slices`): a Python share
#: costs its thread tens of microseconds to take the GIL, about what a memory-bound
#: pass spends on a few hundred thousand elements.  On the 2-vCPU Zen 3 a 200k-code
#: residual sum ran 77 us on one thread, 78-103 on two; 1.6M codes 580 and 390.
MIN_ELEMENTS = 1 << 19


def for_slices(fn, length, elements):
    """``fn(slice)`` for consecutive slices covering ``range(length)``, one per thread
    (:func:`tilegemm.get_num_threads`, fewer for a pass of few ``elements``); the
    caller runs the first and returns when all are done.  ``fn`` must write only
    what its slice owns.

    For memory-bound passes (layout conversions, pooling, residual sums, quantizing)
    in numpy or jitted loops that release the GIL.  The slices go to the spinning
    pool like any other shares (on a queue-based executor each pass woke a sleeping
    thread: a 200k-code residual sum took 0.17-0.35 ms on two threads against 0.10
    on one, a 2-vCPU VM).
    """
    parts = min(get_num_threads(), length, max(1, elements // MIN_ELEMENTS))
    if parts <= 1:
        fn(slice(0, length))
        return
    bounds = [length * i // parts for i in range(parts + 1)]
    run_shares(fn, [(slice(a, b),) for a, b in zip(bounds, bounds[1:])])
