"""How tilegemm measures itself: one set of timing rules for the CLI and ``bench/``.

``python -m tilegemm bench`` and the pytest-benchmark suites in ``bench/`` both call
the functions here, so they never disagree on what is measured.

The rules (see docs/reports.md):

* **Warm-up apart.**  The first call of every party is timed on its own and
  reported as ``first_call_s``: for tilegemm it includes JIT compilation (or
  loading Numba's cache); it never enters the GFLOPS figure.
* **Best of N, interleaved.**  Each repetition times every party once, in an
  order rotated from one repetition to the next (ours, numpy, torch; then numpy,
  torch, ours; ...), so a drift of the machine's speed hits all parties alike.
  The best repetition is the figure; the spread of the others is kept as the noise.
* **Calls per sample.**  Small products take microseconds, below the timer's
  useful resolution, so one sample is ``calls`` back-to-back calls, with
  ``calls`` chosen per party so that a sample lasts at least ``min_time``.
* **Threads pinned.**  Every party runs with the same thread count: Numba's
  ``set_num_threads``, OpenBLAS through threadpoolctl, ``torch.set_num_threads``.
  With more than one thread each sample follows a pause (:func:`settle_time`, so
  the previous party's spinning workers stop) and a ramp of untimed calls
  (:func:`ramp_time`, so the machine is back to speed).
* **GFLOPS = 2·M·N·K / t**, and % of the *measured* FMA peak for the same thread
  count (:func:`tilegemm.kernels.peak.measured_peak_gflops`).
"""
import contextlib
import importlib
import os
import statistics
import time
from dataclasses import dataclass, field

import numba

from tilegemm.ground import threads as thread_settings
import numpy as np


# --------------------------------------------------------------------------- optional peers

def optional_import(name):
    """Import ``name`` and return the module, or None when it is not installed.

    A ``sys.modules[name] = None`` entry (how tests simulate a missing package)
    makes the import fail like a missing package does.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def torch_module():
    """``torch`` when installed, else None."""
    return optional_import("torch")


# --------------------------------------------------------------------------- threads

def max_threads():
    """The largest thread count every party can be pinned to (Numba's pool size)."""
    return int(numba.config.NUMBA_NUM_THREADS)


@contextlib.contextmanager
def pinned_threads(threads):
    """Run the block with every party limited to ``threads`` threads.

    tilegemm via its process-wide limit (``tilegemm.set_num_threads``) and Numba's
    per-thread setting (which also caps it), OpenBLAS (numpy) via
    threadpoolctl's BLAS limit, torch via ``torch.set_num_threads`` when torch is
    already imported.  Previous settings are restored on exit.

    Raises
    ------
    ValueError
        If ``threads`` is not between 1 and :func:`max_threads`.
    """
    threads = int(threads)
    if not 1 <= threads <= max_threads():
        raise ValueError(f"threads must be between 1 and {max_threads()}, got {threads}")
    saved_numba = numba.get_num_threads()
    saved_tilegemm = thread_settings.process_limit()
    torch = torch_module()
    saved_torch = torch.get_num_threads() if torch else None
    try:
        with contextlib.ExitStack() as stack:
            threadpoolctl = optional_import("threadpoolctl")
            if threadpoolctl is not None:
                # BLAS only: an OpenMP limit would also reach the OpenMP pool Numba runs
                # on.  On leaving, threadpoolctl puts back every library's limit as it
                # found it, tilegemm's too: so it is entered before tilegemm's is set.
                stack.enter_context(threadpoolctl.threadpool_limits(limits=threads,
                                                                    user_api="blas"))
            numba.set_num_threads(threads)
            thread_settings.set_num_threads(threads)
            if torch:
                torch.set_num_threads(threads)
            yield
    finally:
        numba.set_num_threads(saved_numba)
        thread_settings.set_num_threads(saved_tilegemm)
        if torch:
            torch.set_num_threads(saved_torch)


# --------------------------------------------------------------------------- timing

@dataclass
class Timing:
    """Times of one party in one benchmark case.

    Attributes
    ----------
    first_call_s : float
        The first call alone (compilation / lazy initialisation included).
    calls : int
        Calls per sample.
    samples_s : list of float
        Time of one call (sample time / ``calls``), one entry per repetition.
    """

    first_call_s: float
    calls: int
    samples_s: list = field(default_factory=list)

    @property
    def best_s(self):
        return min(self.samples_s)

    @property
    def max_s(self):
        return max(self.samples_s)

    @property
    def median_s(self):
        return statistics.median(self.samples_s)

    @property
    def spread(self):
        """Relative noise of the repeats: (median - best) / best."""
        return self.median_s / self.best_s - 1.0

    def as_dict(self):
        return {"best_s": self.best_s, "min_s": self.best_s, "median_s": self.median_s,
                "max_s": self.max_s, "spread": self.spread,
                "first_call_s": self.first_call_s, "calls": self.calls,
                "samples_s": list(self.samples_s)}


def _time_calls(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def calibrate(fn, min_time):
    """Calls for one sample of ``fn`` to last ``min_time`` seconds: (calls, sample seconds)."""
    calls = 1
    while True:
        elapsed = _time_calls(fn, calls)
        if elapsed >= min_time or calls >= 1 << 20:
            return calls, elapsed
        # Aim 20% past the target so that the next try usually succeeds.
        calls = max(calls * 2, int(calls * 1.2 * min_time / max(elapsed, 1e-9)) + 1)


def warm_up(fn):
    """Call ``fn`` once and return how long that first call took (seconds)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def settle_time(threads):
    """Pause before each sample so the previous party's idle threads stop spinning.

    Multi-threaded libraries keep their workers spinning after a call (OpenBLAS
    for about 0.1 s) and on a machine with few cores those spinners steal the
    next party's cores: measured here, the party after numpy lost up to half its
    speed at 2 threads, and a 0.15-0.2 s pause removed the effect.  With one
    thread nobody spins, so no pause is needed.
    """
    return 0.15 if threads > 1 else 0.0


def ramp_time(threads):
    """Seconds of untimed calls after the pause, before each sample is timed.

    After an idle pause a virtual machine's cores can stay slow for a while: on the
    2-vCPU Zen 3 machine of ``bench/results``, a 256^3 product on 2 threads took
    0.6-0.7 ms a call for the first 60 ms after a 0.15 s pause and 0.35 ms from then
    on, and a 50 ms sample taken at once measured a spell of the host rather than
    the code (ours 0.56x numpy there, 0.65x after 0.1 s of calls; at 384^3, 0.78x
    and 1.02x).  Every party gets the same ramp, so each is timed as a loop of calls
    runs in steady state.  Single-thread samples take neither the pause nor the ramp.
    """
    return 0.1 if threads > 1 else 0.0


def before_sample(fn, settle, ramp):
    """Sleep ``settle`` seconds, then call ``fn`` for ``ramp`` seconds (untimed)."""
    time.sleep(settle)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < ramp:
        fn()


def interleaved(parties, reps=5, min_time=0.05, settle=0.0, budget=None, first_calls=None,
                ramp=0.0):
    """Time several implementations of the same work, best of ``reps``, interleaved.

    Parameters
    ----------
    parties : dict of str -> callable
        Zero-argument callables doing the same work (e.g. ours, numpy, torch).
    reps : int
        Repetitions; the best is the result, the others give the spread.
    min_time : float
        Minimum length of one sample in seconds (short calls are repeated).
    settle : float
        Seconds to sleep before each sample (see :func:`settle_time`).
    budget : float, optional
        Seconds of timed samples allowed per party.  A party whose sample is
        long gets fewer repetitions (at least one) and drops out of the later
        rounds, so one very slow algorithm does not hold the whole run up.
    first_calls : dict of str -> float, optional
        First-call times already measured by the caller; those parties skip
        the warm-up call here.
    ramp : float
        Seconds of untimed calls after each pause, before the sample (see
        :func:`ramp_time`).

    Returns
    -------
    dict of str -> Timing
        In the order of ``parties``.
    """
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    first_calls = first_calls or {}
    names = list(parties)
    timings, party_reps = {}, {}
    for name in names:
        time.sleep(settle)
        first = first_calls[name] if name in first_calls else warm_up(parties[name])
        calls, sample_s = calibrate(parties[name], min_time)
        timings[name] = Timing(first_call_s=first, calls=calls)
        party_reps[name] = reps if budget is None else max(1, min(reps, int(budget / sample_s)))
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            t = timings[name]
            if len(t.samples_s) >= party_reps[name]:
                continue
            before_sample(parties[name], settle, ramp)
            t.samples_s.append(_time_calls(parties[name], t.calls) / t.calls)
    return timings


def threads_text(threads):
    """``"1 thread"``, ``"2 threads"``."""
    threads = int(threads)
    return f"{threads} thread" + ("" if threads == 1 else "s")


def gflops(flops, seconds):
    """Billions of floating-point operations per second."""
    return flops / seconds / 1e9


def load_average():
    """1-minute load average (None where the OS does not report it).

    Recorded in reports: a load near the core count while benchmarking means
    other processes shared the cores and the figures are pessimistic.
    """
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


_peaks = {}


def peak_gflops(dtype, threads):
    """Measured FMA peak of ``threads`` threads for ``dtype`` (cached per process)."""
    from tilegemm.kernels.peak import measured_peak_gflops
    key = (np.dtype(dtype).name, int(threads))
    if key not in _peaks:
        _peaks[key] = measured_peak_gflops(np.dtype(dtype).type, int(threads))
    return _peaks[key]


def summarise(timings, flops, peak):
    """Turn timings into the JSON-ready figures of one report row.

    Parameters
    ----------
    timings : dict of str -> Timing
    flops : float
        Floating-point operations of one call.
    peak : float or None
        Measured peak GFLOPS for this dtype and thread count.

    Returns
    -------
    dict of str -> dict
        Per party: the :class:`Timing` fields plus ``gflops`` and ``pct_peak``.
    """
    out = {}
    for name, t in timings.items():
        row = t.as_dict()
        row["gflops"] = gflops(flops, t.best_s)
        row["pct_peak"] = 100.0 * row["gflops"] / peak if peak else None
        out[name] = row
    return out


# --------------------------------------------------------------------------- memory

#: Largest buffer :func:`memory_bandwidth` copies (two of them are allocated).  A
#: virtual machine reports its host's whole L3 (260 MiB on the 2-core Xeon VM), of
#: which it gets a share: there 128 MiB and 1 GiB copies measured 19.6 and 18.7 GB/s,
#: and the 1 GiB one took 7 s, mostly faulting pages in.
BANDWIDTH_MAX_BYTES = 256 << 20


def memory_bandwidth(cache_bytes, reps=5):
    """Measured memory bandwidth in GB/s: ``numpy.copyto`` of a buffer 4x ``cache_bytes``.

    The buffer is four times the last-level cache (at least 64 MiB, at most
    :data:`BANDWIDTH_MAX_BYTES`: the report states the ratio), so the copy streams
    from memory; the figure is the
    best of ``reps`` copies, counting the bytes read plus the bytes written (STREAM's
    "copy" convention).  One thread: numpy copies serially.

    Returns
    -------
    dict
        ``gbps``, ``buffer_bytes``, ``reps`` and ``method`` (a sentence for the report).
    """
    nbytes = int(min(max(4 * cache_bytes, 64 << 20), BANDWIDTH_MAX_BYTES))
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page before timing
    best = min(_time_calls(lambda: np.copyto(dst, src), 1) for _ in range(reps))
    ratio = f"{src.nbytes / cache_bytes:.1f}x the last-level cache" if cache_bytes else "no cache size"
    return {"op": "bandwidth", "gbps": 2 * src.nbytes / best / 1e9, "buffer_bytes": src.nbytes,
            "reps": reps, "method": (f"numpy copy of {src.nbytes >> 20} MiB ({ratio}), 1 thread, "
                                     f"best of {reps}, bytes read + written")}
