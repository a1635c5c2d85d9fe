"""Calls through compiled entry points (``ground/entries.py``)."""
import numba
import numpy as np

from tilegemm.ground.entries import Entries


@numba.njit
def _sum_into(x, out):
    out[0] = x.sum()
    return x.size


def test_entries_call_the_overload_of_each_key():
    run = Entries(_sum_into)
    out = np.zeros(1)
    for _ in range(2):       # the first call of a key dispatches, the next takes its entry
        assert run("float", np.arange(4.0), out) == 4 and out[0] == 6.0
        assert run("int", np.arange(5), out) == 5 and out[0] == 10.0
    frozen = np.arange(3.0)
    frozen.setflags(write=False)
    assert run("read-only", frozen, out) == 3 and out[0] == 3.0
    assert run("read-only", frozen, out) == 3 and out[0] == 3.0
    assert run.dispatcher is _sum_into and len(_sum_into.signatures) == 3
