"""Thread control: set_num_threads, thread_limit, threadpoolctl, and the threads a call really uses."""
import os
import threading
import time

import numpy as np
import pytest

import tilegemm
from conftest import assert_close, error_bound
from tilegemm.ground import threads
from tilegemm.kernels import driver

threadpoolctl = pytest.importorskip("threadpoolctl")


@pytest.fixture(autouse=True)
def restore_limit():
    before = threads.process_limit()
    yield
    tilegemm.set_num_threads(before)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError),
                                        (threads.max_threads() + 1, ValueError),
                                        (1.5, TypeError), (True, TypeError), ("2", TypeError)])
def test_bad_thread_counts_are_refused(bad, error):
    with pytest.raises(error, match="thread count"):
        tilegemm.set_num_threads(bad)
    with pytest.raises(error, match="thread count"):
        with tilegemm.thread_limit(bad):
            pass


def test_set_num_threads_and_thread_limit():
    tilegemm.set_num_threads(1)
    assert tilegemm.get_num_threads() == 1
    tilegemm.set_num_threads(threads.max_threads())
    assert tilegemm.get_num_threads() == threads.max_threads()
    with tilegemm.thread_limit(1):
        assert tilegemm.get_num_threads() == 1
        with tilegemm.thread_limit(threads.max_threads()):   # never raises the outer limit
            assert tilegemm.get_num_threads() == 1
        assert tilegemm.get_num_threads() == 1
    assert tilegemm.get_num_threads() == threads.max_threads()


def test_thread_limit_belongs_to_its_python_thread():
    inside, seen = threading.Event(), {}
    release = threading.Event()

    def limited():
        with tilegemm.thread_limit(1):
            seen["limited"] = tilegemm.get_num_threads()
            inside.set()
            release.wait(10)

    t = threading.Thread(target=limited)
    t.start()
    assert inside.wait(10)
    seen["other"] = tilegemm.get_num_threads()
    release.set()
    t.join()
    assert seen == {"limited": 1, "other": threads.max_threads()}


def test_threadpoolctl_lists_and_limits_tilegemm():
    infos = [i for i in threadpoolctl.threadpool_info() if i["internal_api"] == "tilegemm"]
    assert len(infos) == 1 and infos[0]["num_threads"] == threads.max_threads()
    assert infos[0]["version"] == tilegemm.__version__
    with threadpoolctl.threadpool_limits(limits=1):
        assert tilegemm.get_num_threads() == 1
    assert tilegemm.get_num_threads() == threads.max_threads()
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        assert tilegemm.get_num_threads() == threads.max_threads()
    with threadpoolctl.threadpool_limits(limits=10 ** 6):     # more than there are: all
        assert tilegemm.get_num_threads() == threads.max_threads()


def _cpu_ticks_per_thread():
    """CPU clock ticks (user + system) of each of this process's threads, by thread id."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue                     # the thread ended meanwhile
        ticks[tid] = int(fields[11]) + int(fields[12])     # utime, stime
    return ticks


def _busy_threads(work, seconds=0.6):
    """How many threads each took a tenth or more of the CPU time of ``work`` run repeatedly."""
    before = _cpu_ticks_per_thread()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()
    after = _cpu_ticks_per_thread()
    used = {tid: after[tid] - before.get(tid, 0) for tid in after}
    total = sum(used.values())
    return sum(1 for u in used.values() if u >= 0.1 * total), total


CALLS = {
    "matmul": lambda rng: (lambda a, b: (lambda: tilegemm.matmul(a, b)))(
        rng.random((768, 768), np.float32), rng.random((768, 768), np.float32)),
    "conv2d": lambda rng: (lambda x, w: (lambda: tilegemm.conv2d(x, w, padding=1)))(
        rng.random((2, 64, 56, 56), np.float32), rng.random((64, 64, 3, 3), np.float32)),
}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("name", sorted(CALLS))
def test_threads_actually_used_follow_the_limits(name):
    work = CALLS[name](np.random.default_rng(0))
    work()                                             # compile outside the count
    with threadpoolctl.threadpool_limits(limits=1):
        busy, total = _busy_threads(work)
    assert total > 0 and busy == 1, f"{name} under threadpool_limits(1): {busy} busy threads"
    if threads.max_threads() < 2:
        return
    with tilegemm.thread_limit(2):
        busy, _ = _busy_threads(work)
    assert busy >= 2, f"{name} with 2 threads allowed: {busy} busy threads"


def test_numba_thread_setting_caps_its_python_thread_only():
    """``numba.set_num_threads`` in one Python thread limits tilegemm there, also once
    Numba's threading layer is up (read from it directly then), and not elsewhere."""
    import numba
    seen = {}

    def capped():
        numba.set_num_threads(1)          # starts Numba's threading layer if not up yet
        seen["capped"] = tilegemm.get_num_threads()
        seen["result"] = tilegemm.matmul(a, b)

    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 200)).astype(np.float32)
    b = rng.standard_normal((200, 300)).astype(np.float32)
    t = threading.Thread(target=capped)
    t.start()
    t.join()
    seen["other"] = tilegemm.get_num_threads()
    assert seen["capped"] == 1
    assert seen["other"] == min(threads.max_threads(), numba.get_num_threads())
    np.testing.assert_allclose(seen["result"], a.astype(np.float64) @ b, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_products_worth_sharing_leave_the_one_call_path(dtype, rng, monkeypatch):
    """A product under the one-call path's size that is worth a second thread goes to
    the threads when this thread may use two, and stays on the one-call path under a
    limit of one; the result is right either way (the small-call cache warm too)."""
    n = 150
    if threads.max_threads() < 2 or 2 * n ** 3 < driver.serial_flops(np.dtype(dtype)):
        pytest.skip("needs two threads and a product worth sharing on this machine")
    launched = []
    real_run = driver.run_native_shares
    monkeypatch.setattr(driver, "run_native_shares",
                        lambda address, blocks: (launched.append(len(blocks)),
                                                 real_run(address, blocks)))
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    ref = a.astype(np.float64) @ b
    for limit, shared in ((1, False), (2, True), (1, False), (2, True)):
        launched.clear()
        with tilegemm.thread_limit(limit):
            got = tilegemm.matmul(a, b)
        assert bool(launched) == shared, limit
        assert_close(got, ref, error_bound(a, b, n, dtype), f"limit {limit}")
