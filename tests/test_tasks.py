"""kernels/tasks.py: task loops on threads as native shares, their rows of slots generated
from the arguments' types."""
import numba
import numpy as np
import pytest

import tilegemm
from tilegemm.kernels import tasks
from tilegemm.kernels.sync import next_task

RECORD = np.dtype([("count", np.int64), ("scale", np.int64)])


@numba.njit(nogil=True)
def _record_tasks(counter, numbers, x, grid, scalars, nested, flag, nothing, out, mine):
    """Each task ``i``: ``out[i]`` from every kind of argument; ``mine[0]`` counts the
    tasks this thread took."""
    count, scale = numbers[0].count, numbers[0].scale
    a, b = scalars
    (g, (h,)) = nested
    while True:
        i = next_task(counter)
        if i >= count:
            break
        extra = 1.0 if flag else 0.0
        if nothing is None:
            extra += 0.5
        out[i] = scale * x[i] + grid[i % grid.shape[0], i % grid.shape[1]] + a + b + g[0] + h + extra
        mine[0] += 1


def _arguments(rng, count, threads):
    numbers = np.zeros(1, RECORD)
    numbers[0]["count"], numbers[0]["scale"] = count, 3
    numbers.flags.writeable = False
    x = rng.standard_normal(count).astype(np.float32)
    grid = rng.standard_normal((3, 5))
    out = np.full(count, np.nan, np.float32)
    mine = np.zeros((threads, 1), np.int64)
    shared = (numbers, x, grid, (np.int32(2), np.float32(0.25)), (np.ones(1), (7,)), True, None)
    expected = (3 * x.astype(np.float64) + grid[np.arange(count) % 3, np.arange(count) % 5]
                + 2 + 0.25 + 1 + 7 + 1.5)
    return shared, out, mine, expected


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_argument_kind_reaches_every_thread(threads, rng):
    """Arrays (1-D, 2-D, a read-only record), integers, floats, bools, None and nested
    tuples cross the rows of slots intact, each thread with its own buffers; the
    tasks are taken once each, by all the threads together."""
    count = 997
    shared, out, mine, expected = _arguments(rng, count, threads)
    tasks.launch_tasks(_record_tasks, lambda t: shared + (out, mine[t]), threads)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert mine.sum() == count
    assert tasks.runs_native(_record_tasks, shared + (out, mine[0]))   # not the fallback


def test_arguments_a_row_cannot_carry_run_as_python_shares(rng):
    """A strided array (not C-contiguous) has no slots: the launch falls back to
    Python shares, with the same result."""
    count = 300
    shared, out, mine, expected = _arguments(rng, count, 2)
    strided = np.zeros((2 * count,), np.float32)[::2]
    strided[:] = shared[1]
    shared = (shared[0], strided) + shared[2:]
    tasks.launch_tasks(_record_tasks, lambda t: shared + (out, mine[t]), 2)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert not tasks.runs_native(_record_tasks, shared + (out, mine[0]))


def test_threads_with_differently_typed_arguments_run_as_python_shares(rng):
    """Threads whose arguments differ in type from the first thread's cannot share its
    reader: Python shares."""
    count = 300
    shared, out, _, expected = _arguments(rng, count, 2)
    mine = [np.zeros(1, np.int64), np.zeros(1, np.int32)]
    tasks.launch_tasks(_record_tasks, lambda t: shared + (out, mine[t]), 2)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert mine[0][0] + mine[1][0] == count


def test_convolutions_from_several_python_threads_on_native_tasks(rng):
    """Two Python threads convolving at once, each on two threads: the rows of slots
    are per Python thread, every result right."""
    from thread_runs import in_threads
    x = rng.standard_normal((1, 40, 40, 32)).astype(np.float32)
    w = rng.standard_normal((48, 32, 3, 3)).astype(np.float32)
    with tilegemm.thread_limit(1):
        want = tilegemm.conv2d(x, w, padding=1, layout="NHWC")

    def run(_):
        with tilegemm.thread_limit(2):
            for _ in range(20):
                got = tilegemm.conv2d(x, w, padding=1, layout="NHWC")
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    in_threads(run, 2)
