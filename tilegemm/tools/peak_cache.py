"""The measured FMA peak, kept on disk per machine so that ``info`` need not measure it again.

Measuring takes about two seconds per dtype and thread count.  The figures are
stored in ``measured-peak.json`` under the tilegemm cache directory
(``TILEGEMM_CACHE_DIR``, default ``~/.cache/tilegemm``), keyed by CPU model, ISA,
thread count and dtype, and reused until ``--remeasure`` asks for new ones.
``bench`` always measures afresh (its % of peak must describe the run) and
stores what it measured.

A set of measurements whose N-thread peak is below :data:`BUSY_SCALING` x N
times the 1-thread peak says that something else used a core while the loop
ran: it comes with a warning and is not stored.
"""
import datetime
import os

from tilegemm.ground.jsonfile import load_json, save_json
from tilegemm.ground.loader import cache_dir

#: The least N-thread / (N x 1-thread) peak of an idle machine (1.8 for 2 threads).
BUSY_SCALING = 0.9

FILE_NAME = "measured-peak.json"


def peak_key(brand, isa, threads, dtype):
    """The cache key of one measurement: CPU model, ISA, thread count and dtype."""
    return f"{brand} | {isa} | {threads} thread(s) | {dtype}"


def busy_warning(dtype, per_threads):
    """A warning when the peaks of ``per_threads`` ({threads: GFLOPS}) scale too little, else ""."""
    one, top = per_threads.get(1), max(per_threads)
    if top < 2 or not one or per_threads[top] is None:
        return ""
    scaling = per_threads[top] / one
    if scaling >= BUSY_SCALING * top:
        return ""
    return (f"warning: the {top}-thread {dtype} peak ({per_threads[top]:.0f} GFLOPS) is only "
            f"{scaling:.2f}x the 1-thread one ({one:.0f}); below {BUSY_SCALING * top:.1f}x "
            "something else was using a core. These peaks are not cached: the next "
            "`tilegemm info` measures again, best on a quiet machine.")


def measured_peaks(machine, dtypes, thread_counts, measure, remeasure=False, path=None):
    """The measured peak of every dtype and thread count, from the cache or measured.

    Parameters
    ----------
    machine : tuple of str
        (CPU model, ISA): the part of the key that names the machine.
    dtypes, thread_counts : sequence
    measure : callable(dtype, threads) -> float
        Measures one peak in GFLOPS.
    remeasure : bool
        Measure everything, ignoring (and replacing) the cached figures.
    path : str, optional
        The cache file; default ``measured-peak.json`` in the tilegemm cache directory.

    Returns
    -------
    peaks : dict
        ``{dtype: {threads: {"gflops", "measured_at", "cached"}}}``; ``cached`` says
        the figure came from the file.
    warnings : list of str
        :func:`busy_warning` for each dtype whose peaks scale too little.
    """
    path = path or os.path.join(cache_dir(), FILE_NAME)
    stored = load_json(path)
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    peaks, warnings, changed = {}, [], False
    for dtype in dtypes:
        keys = {t: peak_key(*machine, t, dtype) for t in thread_counts}
        if not remeasure and all(k in stored for k in keys.values()):
            peaks[dtype] = {t: dict(stored[k], cached=True) for t, k in keys.items()}
            continue
        peaks[dtype] = {t: {"gflops": measure(dtype, t), "measured_at": now, "cached": False}
                        for t in thread_counts}
        warning = busy_warning(dtype, {t: p["gflops"] for t, p in peaks[dtype].items()})
        if warning:
            warnings.append(warning)
            continue
        for t, key in keys.items():
            stored[key] = {"gflops": peaks[dtype][t]["gflops"], "measured_at": now}
        changed = True
    if changed:
        save_json(path, stored)
    return peaks, warnings
