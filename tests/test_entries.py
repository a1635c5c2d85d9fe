"""Calls through compiled entry points (``ground/entries.py``)."""
import numba
import numpy as np

from tilegemm.ground.entries import Entries


@numba.njit
def _sum_into(x, out):
    out[0] = x.sum()
    return x.size


class _Counted:
    """A dispatcher whose calls are counted (the entry points bypass it)."""

    def __init__(self, dispatcher):
        self.dispatcher, self.calls = dispatcher, 0

    def __call__(self, *args):
        self.calls += 1
        return self.dispatcher(*args)

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)


def test_entries_call_the_overload_of_each_key():
    counted = _Counted(_sum_into)
    run = Entries(counted)
    out = np.zeros(1)
    frozen = np.arange(3.0)
    frozen.setflags(write=False)
    for _ in range(3):       # the first call of a key dispatches, the next take its entry
        assert run("float", np.arange(4.0), out) == 4 and out[0] == 6.0
        assert run("int", np.arange(5), out) == 5 and out[0] == 10.0
        assert run("read-only", frozen, out) == 3 and out[0] == 3.0
    assert counted.calls == 3 and len(_sum_into.signatures) == 3
