"""The crew that runs the shares of a product: every share once, errors to the caller,
concurrent callers, and a forked child."""
import multiprocessing
import threading

import numpy as np
import pytest

import tilegemm
from tilegemm.kernels import crew


def _fill(out, i, value):
    out[i] = value


@pytest.mark.parametrize("nshares", [1, 2, 3])
def test_every_share_runs_once(nshares):
    for round_ in range(50):
        out = np.zeros(nshares)
        crew.run_shares(lambda i: _fill(out, i, out[i] + round_ + 1), [(i,) for i in range(nshares)])
        assert np.all(out == round_ + 1)


def test_errors_reach_the_caller_and_the_crew_goes_on():
    def share(i):
        if i == 1:
            raise ValueError("share 1 failed")
        out[i] = 1

    out = np.zeros(2)
    with pytest.raises(ValueError, match="share 1 failed"):
        crew.run_shares(share, [(0,), (1,)])
    assert out[0] == 1   # the caller's own share still ran
    out[:] = 0
    crew.run_shares(lambda i: _fill(out, i, 5), [(0,), (1,)])
    assert np.all(out == 5)


def test_caller_error_waits_for_the_workers():
    done = threading.Event()

    def share(i):
        if i == 0:
            raise KeyError("caller's share")
        done.wait(0.05)
        out[i] = 1

    out = np.zeros(2)
    with pytest.raises(KeyError):
        crew.run_shares(share, [(0,), (1,)])
    assert out[1] == 1, "run_shares returned before the worker's share ended"


def test_concurrent_callers():
    """Callers that find the crew busy use the fallback pool; every result is right."""
    errors = []

    def caller(seed):
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((300, 200)).astype(np.float32)
        b = rng.standard_normal((200, 310)).astype(np.float32)
        ref = a.astype(np.float64) @ b
        try:
            for _ in range(5):
                got = tilegemm.matmul(a, b)
                np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert not errors, errors[0]


def _child(queue):
    out = np.zeros(2)
    crew.run_shares(lambda i: _fill(out, i, 3), [(0,), (1,)])
    queue.put(out.tolist())


def test_forked_child_rebuilds_the_crew():
    crew.run_shares(lambda i: None, [(0,), (1,)])      # the parent's crew exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("run_shares hung in a forked child")
    assert child.exitcode == 0
    assert queue.get(timeout=5) == [3.0, 3.0]
