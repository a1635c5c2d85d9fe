"""Thread scaling of the convolution suite: 1 thread against N, timed in the same rounds.

On a shared machine figures from separate runs drift more than the speed-up
being measured, so every party runs at 1 thread and at N threads within each
round (:func:`run_scaling_case`).  Beside it, :func:`run_apart` times N
independent 1-thread calls at once against one alone: the speed-up the machine
gives work that shares nothing but the hardware, the yardstick for the
speed-up of one call split between threads.
"""
import threading
import time

import numba

from tilegemm.tools import conv_suite, timing


def _at(threads, fn, torch):
    """``fn`` run with ``threads`` threads, set on every call.

    Set directly: threadpoolctl's limits (:func:`timing.pinned_threads`) cost
    milliseconds per entry, inside the timed loop.
    """
    def call():
        numba.set_num_threads(threads)
        if torch is not None:
            torch.set_num_threads(threads)
        return fn()
    return call


def run_scaling_case(case, reps=5, min_time=0.05, peers=("torch",), budget=10.0):
    """Time every party of ``case`` at 1 thread and at ``case.threads`` in the same rounds.

    Returns
    -------
    dict
        JSON-ready row: the layer, ``rows`` (per party: ``one_s`` and ``many_s``,
        best seconds per call at 1 and at ``threads`` threads, and ``speedup``),
        ``not_applicable`` (algorithm -> reason) and ``apart`` (:func:`run_apart`).
    """
    x, w = conv_suite.operands(case)
    many = case.threads
    # numpy's BLAS threads can only be set through threadpoolctl, too slow inside the loop.
    peers = tuple(p for p in peers if p != "numpy")
    torch = timing.torch_module()
    with timing.pinned_threads(many):
        parties, _, _, not_applicable = conv_suite.gather_parties(case, x, w, peers)
        timed = {}
        for name, fn in parties.items():
            timed[f"{name}@1"] = _at(1, fn, torch)
            timed[f"{name}@{many}"] = _at(many, fn, torch)
        timings = timing.interleaved(timed, reps=reps, min_time=min_time,
                                     settle=timing.settle_time(many),
                                     ramp=timing.ramp_time(many), budget=budget)
        apart = run_apart(case, reps, min_time)
    rows = []
    for name in parties:
        one, par = timings[f"{name}@1"].best_s, timings[f"{name}@{many}"].best_s
        rows.append({"party": name, "one_s": one, "many_s": par, "speedup": one / par})
    ly = case.layer
    return {"op": "conv-scaling", "layer": ly.name, "shape": ly.describe(),
            "batch": case.batch, "dtype": case.dtype, "threads": many, "layout": case.layout,
            "reps": reps, "rows": rows, "not_applicable": not_applicable,
            "apart": apart}


def run_apart(case, reps=5, min_time=0.05):
    """Seconds per call of ``algorithm="auto"`` on 1 thread alone, and with N such calls at once.

    Each of N = ``case.threads`` Python threads runs its own 1-thread calls on its
    own operands, started together; the slowest one's time per call is the
    "together" figure.  ``N * alone / together`` is the speed-up the machine gives
    independent work on this layer.  Alone and together alternate round by round,
    best of ``reps``.

    Returns
    -------
    dict
        ``alone_s``, ``together_s`` and ``speedup``.
    """
    n_threads = case.threads
    calls_of = [conv_suite.tilegemm_party(*conv_suite.operands(case, seed=i), case.layer,
                                          "auto", case.layout) for i in range(n_threads)]

    def per_call(i, n):
        numba.set_num_threads(1)  # Numba's thread count is per calling thread
        t0 = time.perf_counter()
        for _ in range(n):
            calls_of[i]()
        return (time.perf_counter() - t0) / n

    per_call(0, 1)  # compiles, prepares the weights
    n = max(1, int(min_time / max(per_call(0, 1), 1e-9)))
    for i in range(1, n_threads):
        per_call(i, 1)
    alone = together = float("inf")
    for _ in range(reps):
        alone = min(alone, per_call(0, n))
        together = min(together, _together(per_call, n_threads, n))
    return {"alone_s": alone, "together_s": together,
            "speedup": n_threads * alone / together}


def _together(per_call, n_threads, n):
    """The slowest of ``n_threads`` Python threads each timing ``n`` calls, started at once."""
    start = threading.Barrier(n_threads)
    times = [0.0] * n_threads

    def worker(i):
        start.wait()
        times[i] = per_call(i, n)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return max(times)
