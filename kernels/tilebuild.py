"""The helper process that writes and compiles micro-kernel tiles (and the Winograd
transforms) for a cold process.

Started by :func:`tilegemm.kernels.tilelib.prefetch` (``python -m
tilegemm.kernels.tilebuild``) the first time a process asks for a tile that is
not cached.  Each request on stdin names a tile and its spec (its writer in
:data:`WRITERS`, then the writer's arguments); the helper writes the tile's
IR with the same code the caller would have used, compiles it, and sends the
object code back on stdout.  The latest request goes first: the template imported
last is the one the caller's next loop runs.  At its first lull it compiles the
pool's jitted functions into Numba's cache (:func:`tilegemm.kernels.pool.warm`),
which the caller's first threaded call then loads.

Messages (:func:`tilelib.send`, :func:`tilelib.receive`): requests ``(symbol,
spec, (triple, cpu, features))``; replies ``(symbol, "started", None)``, then
``(symbol, "done", object_code)`` or ``(symbol, "failed", message)``.
"""
import sys
import threading

from tilegemm.kernels import pool, tilelib, winograd
from tilegemm.kernels.microkernel import tile_function

#: Writers of the functions the helper builds, by the first item of a request's spec
#: (the rest are the writer's arguments): micro-kernel tiles and Winograd transforms.
WRITERS = {"tile": tile_function, **winograd.WRITERS}


#: A helper with nothing to do for this long exits (the caller starts another when needed).
IDLE_EXIT_SECONDS = 5.0


def serve(requests, replies):
    """Compile requested tiles, latest first, until ``requests`` ends or stays idle.

    A thread drains ``requests`` as they come, so that a caller's write never waits
    for a compile.
    """
    pending = []
    changed = threading.Condition()

    def drain():
        while (job := tilelib.receive(requests)) is not None:
            with changed:
                pending.append(job)
                changed.notify()
        with changed:
            pending.insert(0, None)
            changed.notify()

    threading.Thread(target=drain, daemon=True).start()
    built = warmed = False
    while True:
        with changed:
            idle = not pending and (warmed or not built)
            if idle and not changed.wait_for(lambda: pending, IDLE_EXIT_SECONDS):
                return
            job = pending.pop() if pending else _LULL
        if job is None:
            return
        if job is _LULL:
            _warm_pool()
            warmed = True
        else:
            _build(job, replies)
            built = True


#: The queue emptied after the first tiles: the caller is compiling its loops.
_LULL = object()


def _warm_pool():
    """The pool's functions into Numba's cache, for the caller's first threaded call."""
    try:
        pool.warm()
    except Exception:  # the caller compiles them itself
        pass


def _build(job, replies):
    symbol, spec, target = job
    tilelib.send(replies, (symbol, "started", None))
    try:
        function = WRITERS[spec[0]](*spec[1:])
        if function.symbol != symbol:
            raise ValueError(f"spec {spec} names {function.symbol}, not {symbol}")
        text = str(tilelib.module_of(symbol, function.fnty, function.body))
        obj = tilelib.compile_ir(text, target)
    except Exception as error:  # the caller compiles the tile itself and raises there
        tilelib.send(replies, (symbol, "failed", repr(error)))
        return
    tilelib.send(replies, (symbol, "done", obj))


if __name__ == "__main__":
    try:
        serve(sys.stdin.buffer, sys.stdout.buffer)
    except (BrokenPipeError, KeyboardInterrupt):
        pass  # the caller's process has ended
