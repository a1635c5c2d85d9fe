"""What a task does on a dask worker: its tilegemm thread count, and objects built
once per worker process (prepared weights, loaded networks) instead of once per task.
"""
import collections
import multiprocessing
import os
import threading
from urllib.parse import urlparse

import dask
import dask.system

import tilegemm

#: Objects a process built, by (kind, token); the oldest go past this many.
CACHE_SIZE = 16

_lock = threading.Lock()
_cache = collections.OrderedDict()
_building = {}                  # (kind, token) -> the lock of its build
#: How many objects of each kind this process built: one per worker, whatever the
#: number of tasks (the tests read it on each worker).
builds = collections.Counter()
#: Threads per task set on this worker by :func:`set_worker_threads`'s plugin.
_plugin_threads = None


def cached(kind, token, build):
    """The object ``build()`` made for ``(kind, token)`` in this process, built on
    first use.  Each key has its own lock while it is built, so two worker threads
    that need the same weights at once build them once, and other keys wait for
    nothing."""
    key = (kind, token)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        building = _building.setdefault(key, threading.Lock())
    with building:
        with _lock:
            if key in _cache:
                return _cache[key]
        value = build()
        with _lock:
            _cache[key] = value
            builds[kind] += 1
            _building.pop(key, None)
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
        return value


def worker_builds():
    """How many objects of each kind this process built (``{"conv": prepared
    weights, "network": loaded networks}``): one per worker process and weights,
    whatever the number of tasks.  Run it on the workers with ``client.run``."""
    with _lock:
        return {"conv": builds["conv"], "network": builds["network"]}


def cores():
    """Cores this process may use: dask's count (the affinity mask and any cgroup
    CPU quota)."""
    return max(1, int(dask.system.CPU_COUNT))


def current_worker():
    """The distributed worker running this task, or None (local schedulers, or
    distributed not installed)."""
    try:
        from distributed import get_worker
        return get_worker()
    except (ImportError, ValueError):
        return None


def _omp_threads():
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def task_threads(threads=None):
    """tilegemm threads for one task here: ``threads`` when given, else the cores
    left for each of the scheduler's threads (None: no limit, the synchronous
    scheduler's single task has them all).

    On a distributed worker: what :func:`set_worker_threads` set, else
    ``OMP_NUM_THREADS`` (distributed's nanny sets it to 1 in the workers it starts,
    one core per worker thread), else the cores over the worker's threads.
    Under the local threaded and process schedulers: the cores over their pool's
    workers (``dask.config`` ``num_workers``, else the cores: give
    ``num_workers`` through ``dask.config.set``, or ``threads=``).
    """
    if threads is not None:
        return int(threads)
    worker = current_worker()
    if worker is not None:
        if _plugin_threads is not None:
            return _plugin_threads
        omp = _omp_threads()
        if omp is not None:
            return omp
        nthreads = getattr(getattr(worker, "state", worker), "nthreads", 1)
        return max(1, cores() // max(1, nthreads))
    if (threading.current_thread() is threading.main_thread()
            and multiprocessing.parent_process() is None):
        return None                             # the synchronous scheduler
    pool = dask.config.get("num_workers", None) or cores()
    return max(1, cores() // pool)


def run(threads, function, *args, **kwargs):
    """``function(*args, **kwargs)`` under this task's thread limit."""
    limit = task_threads(threads)
    if limit is None:
        return function(*args, **kwargs)
    with tilegemm.thread_limit(max(1, min(limit, tilegemm.get_num_threads()))):
        return function(*args, **kwargs)


def host_of(address):
    """The host part of a worker's address (``tcp://10.0.0.1:4000`` -> ``10.0.0.1``)."""
    return urlparse(address).hostname or address


def plugin_threads():
    """Threads per task that :func:`set_worker_threads` gave this worker, or None."""
    return _plugin_threads


def _set_plugin_threads(value):
    global _plugin_threads
    _plugin_threads = value


def _plugin(host_threads):
    from distributed.diagnostics.plugin import WorkerPlugin

    class TilegemmThreads(WorkerPlugin):
        """Sets each worker's tilegemm threads per task: its host's cores over the
        worker threads of every worker on that host."""

        name = "tilegemm-threads"

        def __init__(self, host_threads):
            self.host_threads = host_threads

        def setup(self, worker):
            total = self.host_threads.get(host_of(worker.address), worker.state.nthreads)
            _set_plugin_threads(max(1, cores() // max(1, total)))

        def teardown(self, worker):
            _set_plugin_threads(None)

    return TilegemmThreads(host_threads)


def set_worker_threads(client):
    """Give every worker of ``client``'s cluster its share of its host's cores.

    Each task's tilegemm threads become ``cores // T`` on its worker, where ``T``
    is the number of worker threads (all workers, all processes) on that host, so
    tilegemm threads x worker threads never exceed the cores.  Without this,
    workers follow ``OMP_NUM_THREADS`` (1 under distributed's nanny).  The counts
    are those of the workers present now: call it again after the cluster scales
    (a worker that restarts keeps its host's count).

    Parameters
    ----------
    client : distributed.Client

    Returns
    -------
    dict
        Worker address -> tilegemm threads per task.
    """
    host_threads = collections.Counter()
    for address, info in client.scheduler_info()["workers"].items():
        host_threads[host_of(address)] += info["nthreads"]
    client.register_plugin(_plugin(dict(host_threads)))
    return client.run(plugin_threads)
