"""The spinning worker pool that runs the shares of a threaded call (kernels/pool.py)."""
import ast
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import numba
import numpy as np
import pytest

import tilegemm
from conftest import assert_close, error_bound
from jitted import trampoline
from tilegemm.kernels import driver, pool
from tilegemm.kernels.driver import gemm_into
from tilegemm.kernels.sync import next_task


@numba.njit(nogil=True)
def _take_tasks(counter, ntasks, done):
    """A task loop like the engine's: take tasks from ``counter``, mark each in ``done``."""
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        done[task] += 1


@pytest.fixture(scope="module")
def spin3():
    """A pool of its own with three workers (more than this machine may have cores)."""
    return pool.SpinPool(3)


def _run(p, fn, shares, gate=None):
    assert p.busy.acquire(blocking=False)
    try:
        p.run(fn, shares, gate)
    finally:
        p.busy.release()


@pytest.mark.parametrize("counts", [[4, 2, 3, 1, 4, 4, 2]])
def test_every_share_runs_once_on_its_own_thread(spin3, counts):
    """Calls of 1 to 4 shares in turn (workers skipped by a call stay in step): every
    share runs exactly once, the first on the caller, the others each on a worker."""
    for rep in range(50):
        for n in counts:
            seen = [None] * n
            _run(spin3, lambda t: seen.__setitem__(t, threading.get_ident()),
                 [(t,) for t in range(n)])
            assert seen[0] == threading.get_ident()
            assert None not in seen and len(set(seen)) == n


def test_gated_task_loop_takes_every_task_once(spin3):
    """With the task counter as gate (the engine's launch), every task runs exactly once."""
    for ntasks in (0, 1, 2, 3, 7, 100):
        for n in (2, 4):
            counter = np.zeros(1, np.int64)
            done = np.zeros(max(ntasks, 1), np.int64)
            _run(spin3, lambda t: _take_tasks(counter, ntasks, done),
                 [(t,) for t in range(n)], gate=counter)
            assert (done[:ntasks] == 1).all()


def test_worker_error_reaches_the_caller_and_the_pool_still_works(spin3):
    def fn(t):
        if t == 2:
            raise KeyError("share 2")

    with pytest.raises(KeyError, match="share 2"):
        _run(spin3, fn, [(t,) for t in range(3)])
    seen = []
    _run(spin3, lambda t: seen.append(t), [(t,) for t in range(4)])
    assert sorted(seen) == [0, 1, 2, 3]


def test_caller_error_waits_for_the_workers(spin3):
    """The workers use the caller's buffers: an error in the caller's share returns only
    after every worker is done."""
    finished = []

    def fn(t):
        if t == 0:
            raise ValueError("caller")
        time.sleep(0.02)
        finished.append(t)

    with pytest.raises(ValueError, match="caller"):
        _run(spin3, fn, [(t,) for t in range(3)])
    assert sorted(finished) == [1, 2]


def test_sleeping_workers_wake_for_the_next_call(spin3):
    """Past their idle spin the workers sleep; a call still reaches them all."""
    for pause in (0.0, 5 * pool.IDLE_SPIN_SECONDS, 0.05):
        time.sleep(pause)
        seen = []
        _run(spin3, lambda t: seen.append(t), [(t,) for t in range(4)])
        assert sorted(seen) == [0, 1, 2, 3]


def test_native_shares_reach_spinning_and_sleeping_workers(monkeypatch):
    """A shared product's native shares run whether the pool's worker spins (posted and
    waited for from jitted code) or has slept past its idle spin (woken first)."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two threads")
    monkeypatch.setattr(driver, "SERIAL_FLOPS", 1)
    pool.start(1)
    rng = np.random.default_rng(8)
    a = rng.standard_normal((120, 80)).astype(np.float32)
    b = rng.standard_normal((80, 150)).astype(np.float32)
    want = a.astype(np.float64) @ b
    # The results are checked after the calls, since a check between calls outlasts
    # the worker's spin.
    seen, results = set(), []

    def call():
        spinning = pool.acquire(1)
        assert spinning is not None
        seen.add(spinning.sleeping[0])
        spinning.busy.release()
        results.append(np.full((120, 150), np.nan, np.float32))
        gemm_into(a, b, results[-1], threads=2)
        return spinning

    for attempt in range(50):       # asleep: idle past its spin
        time.sleep(0.05)
        spinning = call()
        if True in seen:
            break
    # spinning: its idle spin made long enough that no descheduling of the worker on a
    # busy machine outlasts it (with the usual millisecond, one had, in 200 calls)
    monkeypatch.setattr(spinning, "idle_spins", spinning.idle_spins * 300)
    for attempt in range(50):
        call()
        if False in seen and attempt >= 3:
            break
    for i, c in enumerate(results):
        assert_close(c, want, 2 * error_bound(a, b, 80, np.float32), f"call {i}")
    assert seen == {True, False}, f"the worker was asleep {seen} at the calls: one path untested"


def test_busy_pool_sends_other_callers_to_the_queue_pool():
    """While one call holds the spinning pool, another thread's call runs on the
    queue-based pool, with the same results."""
    pool.start(1)
    held = pool.acquire(1)
    assert held is not None
    try:
        assert pool.acquire(1) is None
        seen = []
        box = []
        t = threading.Thread(target=lambda: box.append(
            pool.run_shares(lambda s: seen.append(s), [(0,), (1,)])))
        t.start()
        t.join(10)
        assert not t.is_alive() and sorted(seen) == [0, 1]
        # Native shares (a shared GEMM) take the queue pool the same way.
        rng = np.random.default_rng(5)
        a = rng.standard_normal((200, 150)).astype(np.float32)
        b = rng.standard_normal((150, 170)).astype(np.float32)
        for shape_b in (b, b[:, :1], b[:, :1].T.copy().reshape(150, 1)):
            c = np.empty((200, shape_b.shape[1]), np.float32)
            t = threading.Thread(target=lambda: driver.gemm_into(a, shape_b, c, threads=2))
            saved = driver.SERIAL_FLOPS, driver.GEMV_SERIAL_ELEMENTS
            driver.SERIAL_FLOPS = driver.GEMV_SERIAL_ELEMENTS = 1
            try:
                t.start()
                t.join(30)
            finally:
                driver.SERIAL_FLOPS, driver.GEMV_SERIAL_ELEMENTS = saved
            assert not t.is_alive()
            np.testing.assert_allclose(c, a.astype(np.float64) @ shape_b, rtol=1e-4, atol=1e-3)
    finally:
        held.busy.release()


def test_concurrent_threaded_products_are_correct():
    """Several Python threads at once, each a 2-thread product: right results, no abort."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 257)).astype(np.float32)
    b = rng.standard_normal((257, 301)).astype(np.float32)
    want = a.astype(np.float64) @ b
    errors = []

    def work():
        for _ in range(10):
            got = tilegemm.matmul(a, b)
            if not np.allclose(got, want, rtol=1e-4, atol=1e-3):
                errors.append("mismatch")

    old = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        numba.set_num_threads(old)
    assert not errors


def _child_product(queue):
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    a = np.arange(400 * 400, dtype=np.float64).reshape(400, 400) % 7
    queue.put(float(np.abs(tilegemm.matmul(a, a) - a @ a).max()))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_forked_child_gets_a_pool_of_its_own():
    """A child forked after the parent's workers started has none of them: it makes its own."""
    a = np.ones((400, 400))
    tilegemm.matmul(a, a)                         # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_product, args=(queue,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 0.0


@pytest.mark.parametrize("count, n", [(4000, 16), (600, 32), (40, 128)])
def test_batched_products_on_native_shares(count, n):
    """Batches on two threads reach the pool as native shares (blocks of addresses the
    caller keeps alive): right results call after call, the unpacked and packed paths."""
    rng = np.random.default_rng(count)
    a = rng.standard_normal((count, n, n)).astype(np.float32)
    b = rng.standard_normal((count, n, n)).astype(np.float32)
    want = np.matmul(a.astype(np.float64), b)
    with tilegemm.thread_limit(2):
        for _ in range(5):
            got = tilegemm.matmul(a, b)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * n)


_THREADED_CALL = """
import numpy as np, tilegemm
from tilegemm.kernels import pool
a = np.ones((512, 512), np.float32)
with tilegemm.thread_limit(2):
    assert (tilegemm.matmul(a, a) == 512).all()
misses = {f.__name__: sum(f.stats.cache_misses.values())
          for f in (pool.serve, pool.signal, pool.run_share)}
print(misses)
"""


def test_warm_compiles_what_the_first_threaded_call_loads(tmp_path):
    """A cold process's tile helper runs ``pool.warm()``: the pool's functions must then
    be in Numba's cache with the very types a threaded call passes them (without the
    warm-up each of the three counts one miss)."""
    env = dict(os.environ, TILEGEMM_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "nb"),
               TILEGEMM_TILE_HELPER="0")

    def run(code):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    run("from tilegemm.kernels import pool; pool.warm()")
    assert ast.literal_eval(run(_THREADED_CALL)) == {"serve": 0, "signal": 0, "run_share": 0}


@pytest.mark.parametrize("shape", [(3000, 40, 300), (40, 3000, 300), (200, 6000, 600),
                                   ("2*MR+1", "2*NR", 50), (900, 900, 900)])
def test_shares_on_one_path_run_only_that_paths_reader(shape, rng, monkeypatch):
    """Products cut into blocks of C: shares that all take one serial path run its own
    native share (a first call compiles that driver alone); mixed paths the general one
    (2*MR+1 rows: a share of 2*MR rows and one of a single row, a GEMV)."""
    monkeypatch.setattr(driver, "SERIAL_FLOPS", 1)
    driver.BLOCKS_PLANS.clear()          # the shares' paths are decided with the plan
    m, n, k = shape
    # 2*MR+1 rows of two column tiles: rows split (C has more row tiles), on the GEMM tile
    n = 2 * driver.kernel_for(np.float32)[0].nr if n == "2*NR" else n
    kern = driver.kernel_for(np.float32, n)[0]
    m = 2 * kern.mr + 1 if m == "2*MR+1" else m
    shares = kern.shares
    kinds, paths = [], []
    real_address, real_route = shares.share_address, driver.route
    monkeypatch.setattr(shares, "share_address", lambda kind: (kinds.append(kind),
                                                               real_address(kind))[1])

    def recorded_route(kern, blk, m, n, k, threads=1, b_strides=None):
        path = real_route(kern, blk, m, n, k, threads, b_strides)
        paths.append((threads, path))
        return path

    monkeypatch.setattr(driver, "route", recorded_route)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = np.zeros((m, n), np.float32)
    gemm_into(a, b, c, threads=2)
    assert_close(c, a.astype(np.float64) @ b, error_bound(a, b, k, np.float32), str(shape))
    if paths[0][1] != "blocks":
        assert not [kind for kind in kinds if kind.startswith("serial")]
        return
    serial = {path for threads, path in paths[1:] if threads == 1}
    assert serial and kinds == (["serial_" + serial.pop()] if len(serial) == 1 else ["serial"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shared_b_tasks_pack_b_together(dtype, rng):
    """``gemm_tasks`` alone: as the first thread (it packs every chunk of B), and as
    one coming when every chunk is taken and packed (it packs none: B's buffer then
    holds the first's copy, and the second run's result depends on it)."""
    kern, blk = driver.kernel_for(np.dtype(dtype), 100)
    mod = kern.module
    m, n, k = 70, 300, 45
    KC, MC, NC = 16, 2 * kern.mr, 2 * kern.nr       # several k, row and column blocks
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    bias = rng.standard_normal(m).astype(dtype)
    from tilegemm.ground.contracts import EPI_BIAS_ROW, EPI_RELU
    epi = EPI_BIAS_ROW | EPI_RELU
    expected = np.maximum(2.0 * (a.astype(np.float64) @ b) + bias[:, None], 0)
    bpack = np.full(k * -(-n // kern.nr) * kern.nr, np.nan, dtype)
    chunks = mod.pack_chunks(n, k, KC, NC)[0]
    assert chunks > 1
    flags = np.zeros(1 + chunks, np.int64)
    gemm_tasks = trampoline(mod.gemm_tasks)         # jitted callers only
    for first in (True, False):
        c = np.full((m, n), np.nan, dtype)
        apack = np.empty(MC * KC, dtype)
        b_read = b if first else np.full_like(b, np.nan)     # the second reads bpack only
        gemm_tasks(np.zeros(1, np.int64), flags, (m, n, k), (dtype(2), dtype(0)),
                   (a.reshape(-1), (0, k, 1)), (b_read.reshape(-1), (0, n, 1)),
                   (c.reshape(-1), (0, n, 1)), (bias, epi), (KC, MC, NC), (apack, bpack))
        assert_close(c, expected, 2 * 2 * error_bound(a, b, k, dtype), f"first={first}")
        assert (flags[1:] == 1).all() and flags[0] >= chunks


@pytest.mark.parametrize("m", [1, 5, 96, 126, 127, 192, 320, 384, 1000, 1024])
@pytest.mark.parametrize("threads", [2, 3])
def test_shared_b_row_blocks_are_balanced_over_the_threads(m, threads):
    """shared_b's MC: whole MR panels, at most the cache's MC; where the cache's MC
    makes few blocks a thread, row blocks that, dealt in turn to the threads, give
    none more than its share of the rows and an MR panel per block it takes (the
    cache's MC gave 384 rows to two threads as 252 and 132); else the cache's."""
    mc, mr = 126, 6
    MC = driver.balanced_rows(m, mc, mr, threads)
    assert MC % mr == 0 and MC <= mc
    if -(-m // mc) >= driver.BALANCE_BLOCKS * threads:
        assert MC == mc
        return
    sizes = [min(MC, m - i) for i in range(0, m, MC)]
    loads = [sum(sizes[t::threads]) for t in range(threads)]
    assert max(loads) <= -(-m // threads) + mr * -(-len(sizes) // threads), (MC, sizes)


def test_share_blocks_are_kept_per_python_thread():
    """A thread's share blocks are reused call after call (same memory, row addresses
    right); another Python thread gets blocks of its own."""
    from tilegemm.ground.workspace import share_blocks
    block, rows = share_blocks("test", 3, 5)
    assert block.shape == (3, 5) and block.dtype == np.int64
    assert list(rows) == [block[r].ctypes.data for r in range(3)]
    again, rows_again = share_blocks("test", 3, 5)
    assert again is block and rows_again is rows
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("block", share_blocks("test", 3, 5)[0]))
    t.start()
    t.join()
    assert not np.shares_memory(other["block"], block)
    assert share_blocks("test", 2, 5)[0] is not block       # another shape, another block
