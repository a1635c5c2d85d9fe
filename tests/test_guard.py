"""The memory-safety helpers of tests/guard.py catch what they claim to catch.

A guard page is proved by crashing a child process on purpose: touching one element
past a guarded array must kill it with SIGSEGV, while touching its first and last
elements must not.  Canaries are proved by writing one element past either edge and
into the gap between rows of a strided view.
"""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from guard import GUARD_PAGES, PAGE, canaried, canaried_strided, guarded_empty

HERE = os.path.dirname(os.path.abspath(__file__))
needs_guard_pages = pytest.mark.skipif(not GUARD_PAGES, reason="no mmap/mprotect here")

# Linux delivers SIGSEGV for a PROT_NONE page; macOS may deliver SIGBUS.
FAULTS = ((-signal.SIGSEGV,) if sys.platform.startswith("linux")
          else (-signal.SIGSEGV, -getattr(signal, "SIGBUS", signal.SIGSEGV)))


def run_child(body):
    """Run ``body`` in a fresh interpreter that can import guard; return the CompletedProcess."""
    code = "import ctypes, numpy as np\nfrom guard import guarded_empty\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONFAULTHANDLER", None)   # no traceback dump: the crash is the expected outcome
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)


@needs_guard_pages
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("shape", [(5, 7), (1,), (1024,), (3, 1000), (0, 3), (3, 0), ()])
@pytest.mark.parametrize("where", ["after", "before"])
def test_guarded_array_sits_against_a_page_edge(where, shape, order, dtype):
    a = guarded_empty(shape, dtype, order=order, where=where)
    assert type(a) is np.ndarray and a.shape == shape and a.dtype == dtype
    assert a.flags.writeable and a.flags.aligned
    if a.size:
        assert a.flags.c_contiguous if order == "C" else a.flags.f_contiguous
    edge = a.ctypes.data + a.nbytes if where == "after" else a.ctypes.data
    assert edge % PAGE == 0, "the array does not touch a page boundary"
    # Every element is usable, the first and the last included.
    a[...] = 3
    assert (a == 3).all()


@needs_guard_pages
def test_guarded_array_keeps_its_mapping_alive():
    view = guarded_empty((100,), np.float64)[10:20]   # the parent array is gone at once
    import gc
    gc.collect()
    view[...] = 1.5
    assert view.sum() == 15


@needs_guard_pages
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("where, order, off", [
    ("after", "C", "a.ctypes.data + a.nbytes"),          # one element past the end
    ("after", "F", "a.ctypes.data + a.nbytes"),
    ("before", "C", "a.ctypes.data - a.itemsize"),       # one element before the start
    ("after", "C", "a.ctypes.data + a.nbytes + 4000"),   # anywhere in the guard page
])
def test_touching_past_a_guarded_edge_kills_with_sigsegv(where, order, off, dtype):
    for access in ("write", "read"):
        stmt = ("ptr.value = 1.0" if access == "write" else "print(ptr.value)")
        proc = run_child(f"""
            a = guarded_empty((7, 5), np.{dtype}, order="{order}", where="{where}")
            a[...] = 2.0                                # the whole array is fine ...
            ptr = ctypes.c_{'float' if dtype == 'float32' else 'double'}.from_address({off})
            print("armed", flush=True)
            {stmt}                                      # ... one element more is not
            print("survived", flush=True)
        """)
        assert "armed" in proc.stdout, proc.stderr     # it got as far as the bad access
        assert "survived" not in proc.stdout, f"{access} past the {where} edge did not fault"
        assert proc.returncode in FAULTS, (proc.returncode, proc.stderr)


@needs_guard_pages
def test_in_bounds_edges_do_not_fault():
    """The control for the test above: the same child touching the edge elements themselves."""
    proc = run_child("""
        for where in ("after", "before"):
            a = guarded_empty((7, 5), np.float32, where=where)
            ctypes.c_float.from_address(a.ctypes.data).value = 1.0
            ctypes.c_float.from_address(a.ctypes.data + a.nbytes - 4).value = 1.0
        print("ok", flush=True)
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@needs_guard_pages
def test_numpy_overrun_through_a_guarded_view_faults():
    """The kind of bug the tests look for: a view one element longer than the array."""
    proc = run_child("""
        a = guarded_empty((64,), np.float64)
        longer = np.lib.stride_tricks.as_strided(a, shape=(65,))
        print("armed", flush=True)
        longer[...] = 0.0
    """)
    assert "armed" in proc.stdout and proc.returncode in FAULTS, (proc.returncode, proc.stderr)


# ---------------------------------------------------------------- canaries

def _longer(a, extra_front=0, extra_back=0):
    """A 1-D view over ``a``'s memory (contiguous ``a``) widened by whole elements."""
    return np.lib.stride_tricks.as_strided(
        np.ndarray((a.size + extra_front + extra_back,), a.dtype, buffer=a.base,
                   offset=a.ctypes.data - a.base.ctypes.data - extra_front * a.itemsize),
        shape=(a.size + extra_front + extra_back,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("order", ["C", "F"])
def test_canaries_stay_quiet_for_writes_inside(dtype, order):
    a, check = canaried((6, 9), dtype, order=order)
    assert np.isnan(a).all() and a.flags["C_CONTIGUOUS" if order == "C" else "F_CONTIGUOUS"]
    a[...] = np.arange(54).reshape(6, 9)
    check()
    a[...] = -0.0
    check()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_canary_catches_one_element_past_the_end(dtype):
    a, check = canaried((6, 9), dtype)
    _longer(a, extra_back=1)[-1] = 0.0
    with pytest.raises(AssertionError, match="after the array"):
        check()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_canary_catches_one_element_before_the_start(dtype):
    a, check = canaried((6, 9), dtype)
    _longer(a, extra_front=1)[0] = 0.0
    with pytest.raises(AssertionError, match="before the array") as info:
        check()
    assert "after" not in str(info.value)


def test_canary_catches_a_single_changed_byte_far_out():
    a, check = canaried((3, 3), np.float64)
    a.base[a.ctypes.data - a.base.ctypes.data + a.nbytes + 4000] ^= 1
    with pytest.raises(AssertionError, match="after the array"):
        check()


@pytest.mark.parametrize("order", ["C", "F"])
def test_canary_catches_a_write_into_the_gap_between_rows(order):
    a, check = canaried_strided((5, 7), np.float32, row_gap=3, order=order)
    assert not a.flags.c_contiguous and not a.flags.f_contiguous
    a[...] = 1.0                        # every element: the gaps are untouched
    check()
    # One element past the end of row 2 (C) / column 2 (F): in the gap, inside the span.
    if order == "C":
        gap = np.lib.stride_tricks.as_strided(a[2], shape=(8,))
    else:
        gap = np.lib.stride_tricks.as_strided(a[:, 2], shape=(6,))
    gap[-1] = 1.0
    with pytest.raises(AssertionError, match="gap between rows"):
        check()


def test_canaried_one_dimensional_gaps_and_empty_arrays():
    v, check = canaried_strided((4,), np.float64, row_gap=1)
    assert v.strides == (16,)
    v[...] = 2.0
    check()
    np.lib.stride_tricks.as_strided(v, shape=(4,), strides=(8,))[1] = 0.0   # between v[0], v[1]
    with pytest.raises(AssertionError, match="gap"):
        check()
    for shape in [(0,), (0, 5), (5, 0), ()]:
        e, check = canaried(shape, np.float32)
        e[...] = 1.0
        check()
