"""Differential fuzzing of ``tilegemm.matmul`` and ``tilegemm.gemm`` against numpy references.

What is generated (see the strategies below):

* shapes: 0, 1, small odd sizes, and the sizes where the engine changes behaviour --
  one below / at / above every register tile's MR and NR and the vector width, above
  MC, around KC and the unpacked path's k block -- read from the kernel plan of the
  dtype, so forced ISAs (``TILEGEMM_ISA=avx2|generic``) get their own edges;
* 1-D operands, batch dimensions that broadcast (size-0 batches and empty m, n, k);
* float32, float64 and mixed;
* memory layouts: C and Fortran order, negative strides, steps of 2 and 3, a
  sub-matrix of a larger array, a C array one element off an aligned start, one a
  byte off (unaligned elements), strides that are not whole elements, zero strides
  (``np.broadcast_to``); every unused byte around an operand is NaN, so a read
  outside it shows in the result;
* ``out=`` / ``c`` in those layouts, NaN-filled when it must be overwritten, or
  sharing memory with an input; ``gemm``'s alpha, beta (0 with NaN in C, 1, 0.5, ...)
  and transposes;
* values: normal or positive or small integers, scaled by powers of two, and now and
  then a NaN or an infinity, which must propagate exactly as in numpy.

Checks: NaN and Inf where the reference has them and nowhere else; elsewhere
``|got - ref| <= LIMIT * (g eps |alpha| (|A| @ |B|) + eps |beta C0|)`` (the largest
ratio seen is recorded per dtype: see :func:`test_zz_report`); every byte of every
input buffer unchanged; every byte of an output's buffer outside its elements
unchanged.

The growth g is sqrt(k): rounding errors of independent terms add up like a random
walk, and sqrt(k) is what keeps the check sharp (at k = 3000 in float32, k eps |A||B|
is as large as one whole term, so a k bound could miss a term dropped from a sum).
It is k when every term of a dot product is the same (both operands constant along
k, e.g. two broadcast operands): the errors then all have one sign and grow
linearly -- measured at 0.125-0.5 k eps |A||B| per block of k the kernels sum in
registers, i.e. up to 13 sqrt(k) eps |A||B| (avx2, k = 769), so a sqrt(k) bound
would fail there.  Long runs (13,750 examples each, several on each of avx512,
avx2 and generic) gave at most 1.95 with sqrt(k) and 0.54 with k: LIMIT = 4 leaves
room for both.

The reference is float64 numpy for float32 results, and ``np.longdouble`` (80-bit on
x86) for float64 results and whenever NaN/Inf are present: a float64 reference
has rounding errors of the same size as a float64 result's, and numpy's own loop
(not BLAS) gives IEEE NaN/Inf semantics.

Separately and deterministically, :func:`test_every_path_is_reached_and_memory_safe`
runs chosen shapes down every GEMM path of ``kernels/driver.py`` (gemv, unpacked,
packed, shared-B, per-thread blocks, split-k, matmul_small) with inputs against
guard pages on either side and outputs against a guard page and inside canaries.
Which path ran is observed by wrapping the driver's routing decision with a recorder
that calls straight through (:class:`PathRecorder`); nothing is forced.
"""
import collections
import contextlib
import functools
import math
import threading

import numba
import numpy as np
import pytest
from hypothesis import given, note, strategies as st

import tilegemm
import tilegemm.api as api
from tilegemm.kernels import batched, driver, small

from fuzz_settings import fuzz_settings, profile_name
from gemm_fuzz_cases import (DTYPE_PAIRS, F32, F64, LAYOUTS_2D, LAYOUTS_ND, LIMIT,
                             MAX_BATCH_MACS, MAX_MACS, OUT_LAYOUTS_2D, WORST, assert_untouched,
                             check, edges, fills, layout, mnk, operand, owned, reference,
                             snapshot, values)
from guard import GUARD_PAGES, canaried_strided, guarded_empty


# Observations of this run, reported by test_zz_report (with gemm_fuzz_cases.WORST).
EXAMPLES = collections.Counter()            # fuzz test -> examples run
PATHS_FUZZED = collections.Counter()        # driver path -> fuzz examples that took it
_lock = threading.Lock()


# ================================================================ observing the driver's paths

class PathRecorder:
    """Which GEMM paths of ``kernels/driver.py`` a call took.

    The driver's routing decision (``driver.route``, asked once per serial product
    and once per threaded one) and ``matmul_small`` are replaced by wrappers that
    note a label and call the original with the same arguments, returning what it
    returns, so a recorded call runs exactly as an unrecorded one.  Labels: the
    route names ``gemv``, ``unpacked``, ``packed`` (serial paths, also inside
    threaded ones), ``shared_b``, ``split_k``, ``blocks`` (threads each on their
    own block of C), ``matmul_small`` (also for ``api.fast_small_matmul`` and the
    compiled entries matmul calls from ``TINY_CALLS``, the same product without the
    general checks), ``gemv`` also for ``api.matvec_into`` (a
    matrix-vector product without the plan), the batched routes of
    ``kernels/batched.py`` (``batched.route``), and ``batched_one_call`` with the route
    it took for ``api.fast_batched`` (a batch in one jitted call).
    """

    WRAPPED = ((driver, "route"), (batched, "route"), (small, "matmul_small"),
               # api imported matmul_small by name: its own binding is what it calls.
               (api, "matmul_small"),
               # matmul's shortest paths: the same product, None when they do not apply.
               (api, "fast_small_matmul"),
               # The matrix-vector product without the general path's plan (``gemv``).
               (api, "matvec_into"),
               # A batch in one jitted call: ``batched_one_call`` and the route it took.
               (api, "fast_batched"))

    #: Wrapped paths that answer None where they do not apply.
    MAY_DECLINE = ("fast_small_matmul", "fast_batched")

    def __init__(self):
        self.log = []          # list.append is atomic: pool threads record too

    def install(self, mp):
        for module, name in self.WRAPPED:
            if hasattr(module, name):
                mp.setattr(module, name, self.wrap(getattr(module, name)))
        mp.setattr(api, "TINY_CALLS", RecordedEntries(api.TINY_CALLS, self.log))

    def wrap(self, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            result = fn(*args, **kwargs)
            # route returns the label; matmul_small is a label of its own, and so is
            # the fast path that takes its place when it applies.
            if fn.__name__ == "route":
                self.log.append(result)
            elif fn.__name__ == "matvec_into":
                self.log.append("gemv")
            elif fn.__name__ == "fast_batched":
                if result is not None:
                    self.log.extend(("batched_one_call", batched.fast_route(*args[:2])))
            elif fn.__name__ not in self.MAY_DECLINE or result is not None:
                self.log.append("matmul_small")
            return result
        return recorded

    @contextlib.contextmanager
    def call(self):
        """``with rec.call() as paths:`` -- ``paths`` (a set) holds the labels afterwards."""
        start = len(self.log)
        paths = set()
        driver.BLOCKS_PLANS.clear()     # so that every share's path is decided (and noted)
        try:
            yield paths
        finally:
            paths.update(self.log[start:])
            del self.log[start:]


class RecordedEntries:
    """``TINY_CALLS`` as ``matmul`` reads it (``get``), each entry wrapped to note
    ``matmul_small`` when it computes the product (it answers False where it does not)."""

    def __init__(self, calls, log):
        self.calls, self.log = calls, log

    def get(self, key):
        tiny = self.calls.get(key)
        if tiny is None:
            return None
        entry = tiny[0]

        def recorded(*args):
            done = entry(*args)
            if done:
                self.log.append("matmul_small")
            return done
        return (recorded,) + tiny[1:]


@pytest.fixture(scope="module", autouse=True)
def recorder():
    rec = PathRecorder()
    with pytest.MonkeyPatch.context() as mp:
        rec.install(mp)
        yield rec


@contextlib.contextmanager
def numba_threads(count):
    """Run with ``count`` Numba threads (at most what Numba was started with), then restore."""
    saved = numba.get_num_threads()
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(saved)


# ================================================================ fuzz: matmul, 2-D

def overlapping(data, rng, x, shape, fill):
    """``x`` moved into a fresh buffer, and a C-order array of ``shape`` overlapping it.

    The new array starts a drawn number of elements into ``x`` (0: at its start), so
    it overlaps part or all of it; the buffer beyond ``x`` holds random values (it
    is read when gemm's beta is not 0).  Returns ``(moved x, overlapping array, buffer)``.
    """
    size = math.prod(shape)
    s = data.draw(st.integers(0, x.size), label="offset into the input")
    buf = np.ldexp(rng.standard_normal(max(x.size, s + size)), fill[1]).astype(x.dtype)
    moved = buf[:x.size].reshape(x.shape)
    moved[...] = x
    return moved, buf[s:s + size].reshape(shape), buf


def _victim(dtype, a, b, la, lb):
    """The inputs an output may alias: same dtype as the result, writeable layout."""
    return [name for name, x, lay in (("a", a, la), ("b", b, lb))
            if x == dtype and not lay.startswith("bcast")]


def _shift_into_output(data, rng, victim, operands, shape, fill):
    """Move input ``victim`` ("a" or "b") into a buffer that the output of ``shape`` also
    lies in (:func:`overlapping`): (a, a's buffer, b, b's buffer, out, out's buffer)."""
    a, pa, b, pb = operands
    moved, out, buf = overlapping(data, rng, a if victim == "a" else b, shape, fill)
    if victim == "a":
        a, pa = moved, buf
    else:
        b, pb = moved, buf
    return a, pa, b, pb, out, buf


def _recorded(recorder, kind, call):
    """``call()`` with the GEMM paths it took recorded (and counted under ``kind``):
    (result, paths)."""
    with recorder.call() as paths:
        got = call()
    with _lock:
        PATHS_FUZZED.update(paths)
        EXAMPLES[kind] += 1
    return got, paths


def _draw_problem(data):
    """(dtype of a, dtype of b, result dtype, (m, n, k)) of one 2-D product."""
    da, db = data.draw(DTYPE_PAIRS, label="dtypes")
    dtype = np.result_type(da, db)
    return da, db, dtype, data.draw(mnk(dtype), label="m, n, k")


@fuzz_settings()
@given(data=st.data())
def test_matmul_2d_matches_numpy(recorder, data):
    """2-D operands in every layout, with or without ``out`` (possibly overlapping an input)."""
    da, db, dtype, (m, n, k) = _draw_problem(data)
    # C order weighted up: both operands in it is matmul's fast path (matmul_small).
    la = data.draw(st.sampled_from(("C",) * 4 + LAYOUTS_2D), label="layout of a")
    lb = data.draw(st.sampled_from(("C",) * 4 + LAYOUTS_2D), label="layout of b")
    out_kind = data.draw(st.sampled_from((None, None) + OUT_LAYOUTS_2D + ("alias", "shifted")),
                         label="out")
    fill = data.draw(fills(), label="fill")
    rng = np.random.default_rng(fill[3])

    victims = _victim(dtype, da, db, la, lb) if out_kind in ("alias", "shifted") else []
    victim = data.draw(st.sampled_from(victims), label="out overlaps") if victims else None
    if out_kind in ("alias", "shifted") and victim is None:
        out_kind = "C"
    if out_kind == "alias":
        # out *is* the input: the shapes must agree (a: n == k, b: m == k), in budget.
        side = min(k, math.isqrt(MAX_MACS // max(m if victim == "a" else n, 1)))
        k = side
        if victim == "a":
            n = side
        else:
            m = side

    a, pa = operand(rng, (m, k), da, la, fill)
    b, pb = operand(rng, (k, n), db, lb, fill)
    if out_kind == "shifted":
        a, pa, b, pb, out, po = _shift_into_output(data, rng, victim, (a, pa, b, pb), (m, n),
                                                   fill)
    elif out_kind == "alias":
        out, po = (a, pa) if victim == "a" else (b, pb)
    elif out_kind is not None:
        out, po = layout((m, n), dtype, out_kind)     # NaN: every element must be written
    else:
        out = po = None
    shares_input = out_kind in ("alias", "shifted")
    note(f"a {a.shape} {a.dtype} strides {a.strides}; b {b.shape} {b.dtype} strides {b.strides}; "
         f"out {None if out is None else (out.shape, out.strides)}")

    a0, b0 = a.copy(), b.copy()
    before = {name: (p, snapshot(p)) for name, p in (("a", pa), ("b", pb))
              if not (shares_input and name == victim)}
    out_before = None if po is None or shares_input else snapshot(po)
    got, paths = _recorded(recorder, "matmul 2-D", lambda: tilegemm.matmul(a, b, out=out))
    out_desc = f"{out_kind}:{victim}" if shares_input else out_kind   # the victim is then in C order
    what = (f"matmul {m}x{k} @ {k}x{n} {da.name}/{db.name} a={la} b={lb} out={out_desc} "
            f"paths={sorted(paths)}")
    if out is not None:
        assert got is out, f"{what}: matmul did not return out"
    check(got, reference(a0, b0), dtype, what)
    for name, (p, snap) in before.items():
        assert_untouched(p, snap, f"{what}: input {name}")
    if out_before is not None:
        assert_untouched(po, out_before, f"{what}: around out", allowed=owned(po, out))


# ================================================================ fuzz: matmul, 1-D and batched

@st.composite
def batched_shapes(draw, dtype):
    """(shape of a, shape of b): 1-D operands or batch dimensions that broadcast."""
    sizes, ks = edges(dtype)
    small = st.one_of(st.integers(0, 9), st.sampled_from([s for s in sizes if s <= 17]))
    m, n = draw(small, label="m"), draw(small, label="n")
    k = draw(st.one_of(st.integers(0, 9), st.sampled_from([s for s in ks if s <= 33])), label="k")
    batch = draw(st.lists(st.sampled_from([1, 2, 3, 0, 2, 1]), max_size=2), label="batch")
    if math.prod(batch) * max(m * n * k, 1) > MAX_BATCH_MACS:
        batch = [1] * len(batch)

    def one(core, vector):
        if vector and draw(st.integers(0, 3)) == 0:   # a 1-D operand now and then
            return (core[1],) if vector == "a" else (core[0],)
        keep = draw(st.integers(0, len(batch)))
        dims = tuple(1 if draw(st.integers(0, 3)) == 0 else d for d in batch[len(batch) - keep:])
        return dims + core

    return one((m, k), "a"), one((k, n), "b")


@fuzz_settings(scale=0.75)
@given(data=st.data())
def test_matmul_batched_and_vectors_match_numpy(recorder, data):
    """N-D and 1-D operands, batch broadcasting (incl. empty batches), ``out`` in a few layouts."""
    da, db = data.draw(DTYPE_PAIRS, label="dtypes")
    dtype = np.result_type(da, db)
    sa, sb = data.draw(batched_shapes(dtype), label="shapes")
    la = data.draw(st.sampled_from(LAYOUTS_ND), label="layout of a")
    lb = data.draw(st.sampled_from(LAYOUTS_ND), label="layout of b")
    fill = data.draw(fills(), label="fill")
    rng = np.random.default_rng(fill[3])
    a, pa = operand(rng, sa, da, la, fill)
    b, pb = operand(rng, sb, db, lb, fill)
    shape = np.matmul(np.zeros(sa, np.float32), np.zeros(sb, np.float32)).shape
    out_kinds = ("C",) if not shape else ("C", "swap", "step", "neg")
    out_kind = data.draw(st.sampled_from((None,) + out_kinds), label="out")
    out, po = layout(shape, dtype, out_kind) if out_kind else (None, None)

    a0, b0 = a.copy(), b.copy()
    before = [(name, p, snapshot(p)) for name, p in (("a", pa), ("b", pb))]
    out_before = None if po is None else snapshot(po)
    got, paths = _recorded(recorder, "matmul batched/1-D",
                           lambda: tilegemm.matmul(a, b, out=out))
    what = (f"matmul {sa} @ {sb} {da.name}/{db.name} a={la} b={lb} out={out_kind} "
            f"paths={sorted(paths)}")
    if out is not None:
        assert got is out, f"{what}: matmul did not return out"
    check(got, reference(a0, b0), dtype, what)
    for name, p, snap in before:
        assert_untouched(p, snap, f"{what}: input {name}")
    if out_before is not None:
        assert_untouched(po, out_before, f"{what}: around out", allowed=owned(po, out))


# ================================================================ fuzz: gemm

#: alpha and beta values: the special ones of BLAS (0, 1) and a few others.
ALPHAS = st.one_of(st.sampled_from([1.0, -1.0, 0.5, 2.5, 0.0]),
                   st.floats(-4, 4, allow_nan=False, width=32))
BETAS = st.one_of(st.sampled_from([0.0, 0.0, 1.0, 0.5, -2.0]),
                  st.floats(-4, 4, allow_nan=False, width=32))
C_LAYOUTS = (None,) + OUT_LAYOUTS_2D + ("shifted",)


@fuzz_settings()
@given(data=st.data())
def test_gemm_matches_numpy(recorder, data):
    """alpha/beta (beta = 0 with NaN in C), transposes, C in any layout or overlapping an input."""
    da, db, dtype, (m, n, k) = _draw_problem(data)
    trans_a = data.draw(st.booleans(), label="trans_a")
    trans_b = data.draw(st.booleans(), label="trans_b")
    la = data.draw(st.sampled_from(LAYOUTS_2D), label="layout of a")
    lb = data.draw(st.sampled_from(LAYOUTS_2D), label="layout of b")
    c_kind = data.draw(st.sampled_from(C_LAYOUTS), label="c")
    alpha = data.draw(ALPHAS, label="alpha")
    beta = data.draw(BETAS, label="beta")
    fill = data.draw(fills(), label="fill")
    rng = np.random.default_rng(fill[3])

    a, pa = operand(rng, (k, m) if trans_a else (m, k), da, la, fill)
    b, pb = operand(rng, (n, k) if trans_b else (k, n), db, lb, fill)
    victims = _victim(dtype, da, db, la, lb) if c_kind == "shifted" else []
    if c_kind == "shifted" and not victims:
        c_kind = "C"
    victim = None
    if c_kind is None:
        c = pc = None
    elif c_kind == "shifted":
        victim = data.draw(st.sampled_from(victims), label="c overlaps")
        a, pa, b, pb, c, pc = _shift_into_output(data, rng, victim, (a, pa, b, pb), (m, n),
                                                 fill)
    else:
        c, pc = layout((m, n), dtype, c_kind)
        if beta != 0:   # beta == 0 leaves the NaN: it must never reach the result
            c[...] = np.ldexp(rng.standard_normal((m, n)), fill[1])
    note(f"a {a.shape} {a.dtype} strides {a.strides}; b {b.shape} {b.dtype} strides {b.strides}; "
         f"c {None if c is None else (c.shape, c.strides)}")

    a0, b0 = a.copy(), b.copy()
    c0 = None if c is None else c.copy()
    before = {name: (p, snapshot(p)) for name, p in (("a", pa), ("b", pb)) if name != victim}
    c_before = None if pc is None or victim else snapshot(pc)
    got, paths = _recorded(recorder, "gemm", lambda: tilegemm.gemm(
        a, b, c, alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b))
    what = (f"gemm {m}x{n}x{k} {da.name}/{db.name} trans=({trans_a},{trans_b}) a={la} b={lb} "
            f"c={c_kind} alpha={alpha} beta={beta} paths={sorted(paths)}")
    if c is not None:
        assert got is c, f"{what}: gemm did not return c"
    op_a = a0.T if trans_a else a0
    op_b = b0.T if trans_b else b0
    expected = reference(op_a, op_b, alpha, beta if c is not None else 0.0, c0)
    check(got, expected, dtype, what)
    for name, (p, snap) in before.items():
        assert_untouched(p, snap, f"{what}: input {name}")
    if c_before is not None:
        assert_untouched(pc, c_before, f"{what}: around c", allowed=owned(pc, c))


# ================================================================ every path, memory-safe

def serial_flops(dtype):
    """The flops from which the driver shares a product (its own rule when it has one)."""
    rule = getattr(driver, "serial_flops", None)
    return rule(dtype) if rule else driver.SERIAL_FLOPS


#: Serial paths a threaded path may run on each thread's share (whichever fits it).
SERIAL_PATHS = {"unpacked", "packed"}


def path_cases(dtype):
    """(required path labels, call, a shape, b shape, B in Fortran order, threads[, L2])."""
    # The threaded shapes are sized from the driver's sharing threshold so that they
    # are shared on any host, but no larger.
    kern, blk = driver.kernel_for(dtype)
    share = 1.25 * serial_flops(dtype)          # flops clearly above the threshold

    def rows_for(n, k):
        return int(math.ceil(share / (2 * n * k)))

    # Tall: C has many more row tiles than column tiles (B is then the larger side).
    tall = max(rows_for(96, 96), 2 * 96 * kern.mr // kern.nr + 1, 8 * kern.mr)
    wide = max(rows_for(16, 96), 8 * kern.nr)
    long_k = max(rows_for(6 * 8, 1), 4 * driver.SPLIT_K_MIN)
    gemv_rows = int(math.ceil(2.5 * driver.GEMV_SERIAL_ELEMENTS / 1024))
    return [
        ({"matmul_small"}, "matmul", (20, 30), (30, 17), False, 1),
        # Past the sharing size on one thread: still one call, on gemm_into's tile and plan.
        ({"matmul_small"}, "matmul", (200, 170), (170, 250), False, 1),
        ({"gemv"}, "matmul", (300,), (300, 77), False, 1),                  # m == 1, 1-D a
        ({"gemv"}, "gemm", (77, 300), (300, 1), False, 1),                  # n == 1
        ({"unpacked"}, "gemm", (40, 60), (60, 50), False, 1),
        ({"packed"}, "gemm", (29, 900), (900, 20), True, 1),   # deep, narrow: the item tile
        # B in Fortran order (non-unit column stride): packed; over MC rows and KC columns.
        ({"packed"}, "gemm", (blk.mc + 5, 2 * blk.kc + 5), (2 * blk.kc + 5, 2 * kern.nr + 3), True, 1),
        # Tall C, B in one block: with a small L2, B packed once, threads take row
        # blocks from a counter; with a large one each thread packs its own (the
        # last element: the L2 the rule is told of, driver.own_b_panels).
        ({"shared_b"}, "gemm", (tall, 96), (96, 96), False, 2, "small"),
        ({"blocks"}, "gemm", (tall, 96), (96, 96), False, 2, "large"),
        # Wide C: each thread its own block of columns (and packs A itself).
        ({"blocks"}, "gemm", (16, 96), (96, wide), False, 2),
        # Matrix-vector products split by rows among threads.
        ({"blocks", "gemv"}, "gemm", (gemv_rows, 1024), (1024, 1), False, 2),
        # C of a few tiles, long k: k split among threads, the parts summed.
        ({"split_k"}, "gemm", (6, long_k), (long_k, 8), False, 2),
        # Batches in one launch: small items unpacked (B broadcast over the first
        # dimension), items whose B has no contiguous rows packed; one item worth
        # sharing, shared by the threads.
        ({"batched_unpacked"}, "matmul", (3, 5, 9, 7), (5, 7, 6), False, 2),
        ({"batched_packed"}, "matmul", (4, 20, 30), (4, 30, 17), True, 1),
        # Rows not a whole number of the blocking's MC for the item's own tile.
        ({"batched_packed"}, "matmul", (3, 63, 40), (3, 40, 20), True, 1),
        ({"batched_items", "shared_b"}, "matmul", (1, tall, 96), (1, 96, 96), False, 2, "small"),
        # C-contiguous 3-D batches on one thread: one jitted call, in place, and packed
        # (B's rows a page apart fall on the same L1 sets; four items, so that no ISA's
        # sharing size makes them one-by-one items).
        ({"batched_one_call", "batched_unpacked"}, "matmul", (5, 9, 7), (5, 7, 6), False, 1),
        # Batch dimensions folded into one: equal, and one side's all 1 (broadcast).
        ({"batched_one_call", "batched_unpacked"}, "matmul", (2, 3, 9, 7), (2, 3, 7, 6), False, 1),
        ({"batched_one_call", "batched_unpacked"}, "matmul", (1, 1, 9, 7), (2, 3, 7, 6), False, 1),
        ({"batched_one_call", "batched_packed"}, "matmul", (4, 96, 40),
         (4, 40, 4096 // dtype.itemsize), False, 1),
    ]


def _placed(values, where, order="C"):
    """A copy of ``values`` against a guard page (``where`` = "after"/"before")."""
    x = guarded_empty(values.shape, values.dtype, order=order, where=where)
    x[...] = values
    return x


def _run_case(recorder, call, a, b, out, beta):
    with recorder.call() as paths:
        if call == "matmul":
            got = tilegemm.matmul(a, b, out=out)
        else:
            got = tilegemm.gemm(a, b, out, beta=beta)
    return got, paths


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_every_path_is_reached_and_memory_safe(recorder, dtype):
    """Each GEMM path of kernels/driver.py, reached by a chosen shape, in four placements:

    plain numpy arrays; inputs starting just after guard pages and the output inside
    canaries (for gemm with canary gaps between its rows too: a C whose row stride
    exceeds its width); inputs and output each ending at a guard page; each starting
    just after one.  gemm runs with beta = 0.5, so C's reads are guarded as well.
    Each placement must take the expected path, match the reference, leave the
    inputs alone and write nothing outside the output's elements.
    """
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("the threaded paths need NUMBA_NUM_THREADS >= 2")
    rng = np.random.default_rng(7)
    reached = set()
    for expect, call, sa, sb, fortran_b, threads, *l2 in path_cases(dtype):
        a_vals = rng.standard_normal(sa).astype(dtype)
        b_vals = rng.standard_normal(sb).astype(dtype)
        b_order = "F" if fortran_b else "C"
        shape = np.matmul(a_vals, b_vals).shape
        c_vals = rng.standard_normal(shape).astype(dtype)
        beta = 0.5 if call == "gemm" else 0.0      # gemm reads C as well: guard its reads too
        expected = reference(a_vals, b_vals, 1.0, beta, c_vals if beta else None)
        what0 = f"{call} {sa} @ {sb} {dtype.name} threads={threads}"

        # Canaries before guard pages: a write just past the output then fails with a
        # message naming the side, before a guard page would end the process.
        placements = [("plain", lambda v, order="C": np.array(v, order=order), None),
                      ("canary", functools.partial(_placed, where="before"), "canary")]
        placements += [(f"guard-{w}", functools.partial(_placed, where=w), w)
                       for w in ("after", "before")]
        for name, place, out_place in placements:
            a = place(a_vals)
            b = place(b_vals, order=b_order)
            check_canary = None
            if out_place in ("after", "before"):
                out = guarded_empty(shape, dtype, where=out_place)
            elif out_place == "canary":
                gap = 3 if call == "gemm" else 0    # matmul_small needs a C-contiguous out
                out, check_canary = canaried_strided(shape, dtype, row_gap=gap)
            else:
                out = np.empty(shape, dtype)
            if beta:
                out[...] = c_vals
            else:
                out[...] = np.nan
            a_snap, b_snap = a.copy(), b.copy()
            with numba_threads(threads), pytest.MonkeyPatch.context() as mp:
                if l2:
                    mp.setattr(driver, "OWN_B_L2_BYTES", 0 if l2[0] == "large" else 1 << 62)
                got, paths = _run_case(recorder, call, a, b, out, beta)
            what = f"{what0} placement={name} paths={sorted(paths)}"
            # Threaded paths run serial ones; a one-call product past OWN_TILE_FLOPS
            # asks route for the plan gemm_into would take.
            allowed = expect | (SERIAL_PATHS if threads > 1 or "matmul_small" in expect
                                else set())
            assert expect <= paths <= allowed, f"{what}: expected the path(s) {sorted(expect)}"
            assert got is out
            check(got, expected, dtype, what)
            assert np.array_equal(a, a_snap) and np.array_equal(b, b_snap), \
                f"{what}: inputs changed"
            if check_canary is not None:
                check_canary()
            reached |= paths
    every = (set(driver.SERIAL_ROUTES + driver.THREADED_ROUTES + batched.BATCHED_ROUTES)
             | {"matmul_small", "batched_one_call"})
    assert every <= reached, f"paths never reached: {sorted(every - reached)}"


# ================================================================ report

def test_zz_report(capsys):
    """Examples run, paths the fuzzing took, and the largest error/bound ratio per dtype.

    Runs last (file order).  Printed with ``-s``, and always under the long profile.
    """
    lines = [f"tilegemm GEMM fuzz ({profile_name()} profile): examples "
             + ", ".join(f"{k}={v}" for k, v in sorted(EXAMPLES.items())),
             "  paths taken by fuzz examples: "
             + ", ".join(f"{k}={v}" for k, v in sorted(PATHS_FUZZED.items())),
             "  largest error / (g eps |alpha||A||B| + eps |beta C0|), g = sqrt(k), or k when"
             f" every term of a dot product is equal; limit {LIMIT}:"]
    for name, (ratio, where) in sorted(WORST.items()):
        lines.append(f"    {name}: {ratio:.3f}  ({where})")
    text = "\n".join(lines)
    if profile_name() == "long":
        with capsys.disabled():
            print("\n" + text)
    else:
        print(text)
    for name, (ratio, where) in WORST.items():
        assert ratio <= LIMIT, where
