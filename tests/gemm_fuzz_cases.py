"""What the GEMM fuzz tests generate and how they judge it: sizes at the engine's edges,
values, memory layouts with NaN around every operand, the extended-precision reference
and the error bound (see test_fuzz_gemm.py's docstring for the why)."""
import collections
import functools
import math
import threading

import numpy as np
import pytest
from hypothesis import strategies as st

from tilegemm.kernels import driver
from tilegemm.kernels.registry import registered_kernels


F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


#: The error bound's constant: |err| <= LIMIT * (g eps |alpha||A||B| + eps |beta C0|), g =
#: sqrt(k) (k for equal terms, see equal_terms).  The largest ratios observed are
#: reported by test_zz_report; test_fuzz_gemm.py's docstring says what long runs showed.
LIMIT = 4.0
#: Multiply-adds per generated 2-D product: keeps an example (and its longdouble
#: reference, numpy's plain loop) to a few milliseconds.
MAX_MACS = 1_000_000
#: ... and per batched product (all batch entries together).
MAX_BATCH_MACS = 100_000

#: Extended precision when the platform has it (x86: 64-bit mantissa).
EXTENDED = np.longdouble if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps else np.float64

# Observations of this run, reported by test_zz_report.
WORST = {}                      # "dtype, growth" -> (largest error/bound ratio, where)
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def edges(dtype):
    """(m/n sizes, k sizes) where the engine for ``dtype`` changes behaviour on this host.

    From the default plan (MR x NR tile, KC/MC blocks, vector width) and every
    narrower register tile the driver may pick for a product with few columns.
    """
    dtype = np.dtype(dtype)
    kern, blk = driver.kernel_for(dtype)
    mrs = {kern.mr} | {mr for d, mr, _, _ in registered_kernels() if d == dtype}
    nrs = {kern.nr} | {nr for d, _, nr, _ in registered_kernels() if d == dtype}
    mn = {0, 1, 2, 3, 5, 7, 2 * kern.mr + 1, blk.mc + 1}
    for x in mrs | nrs | {blk.lanes}:
        mn |= {x - 1, x, x + 1}
    # The vector width and 4 of them (the GEMV kernels' unroll), KC, the unpacked k block.
    k = {0, 1, 2, 3, 5, 7, blk.lanes - 1, blk.lanes, blk.lanes + 1, 4 * blk.lanes - 1,
         4 * blk.lanes + 1, blk.kc - 1, blk.kc, blk.kc + 1, 2 * blk.kc + 1,
         driver.UNPACKED_KC + 1}
    return tuple(sorted(s for s in mn if s >= 0)), tuple(sorted(s for s in k if s >= 0))


def size_at_most(candidates, limit, small=40):
    """A size <= ``limit``: an interesting one or any small one."""
    chosen = [s for s in candidates if s <= limit] or [0]
    # 0 comes from the candidates: drawn from the integers too, it would crowd out the rest.
    return st.one_of(st.sampled_from(chosen), st.integers(min(1, limit), max(0, min(small, limit))))


@st.composite
def mnk(draw, dtype, budget=MAX_MACS):
    """(m, n, k): k first (it may be just above KC), then m and n within the budget."""
    sizes, ks = edges(dtype)
    # The block edges (KC, the unpacked k block) get as many draws as the small sizes.
    k = draw(st.one_of(size_at_most(ks, budget, small=48), st.sampled_from(ks)), label="k")
    m = draw(size_at_most(sizes, budget // max(k, 1)), label="m")
    n = draw(size_at_most(sizes, budget // max(k * m, 1)), label="n")
    return m, n, k


#: (dtype of a, dtype of b): same-dtype products weighted up, mixed ones compute in float64.
DTYPE_PAIRS = st.sampled_from([(F32, F32)] * 3 + [(F64, F64)] * 2 + [(F32, F64), (F64, F32)])


@st.composite
def fills(draw):
    """How an example's values are drawn: (distribution, power-of-two scale, specials?, seed).

    Positive values make every dot product a sum without cancellation (the error
    bound at its tightest); small integers make most products exact; a NaN or an
    infinity now and then checks propagation.
    """
    return (draw(st.sampled_from(["normal", "normal", "positive", "integers"])),
            draw(st.integers(-10, 10)),
            draw(st.sampled_from([False] * 9 + [True])),
            draw(st.integers(0, 2 ** 32 - 1)))


def values(rng, shape, fill, dtype):
    """Random values of ``shape`` drawn as ``fill`` says, exactly representable in ``dtype``."""
    kind, scale, specials, _ = fill
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "positive":
        x = rng.uniform(0.5, 2.0, shape)
    else:
        x = rng.integers(-4, 5, shape).astype(np.float64)
    x = np.ldexp(x, scale).astype(dtype)
    if specials and x.size:
        flat = x.reshape(-1)
        for i in rng.integers(0, x.size, rng.integers(1, 3)):
            flat[i] = rng.choice([np.nan, np.inf, -np.inf])
    return x


#: Layouts of a 2-D operand (see :func:`operand`); "bcast*" are read-only, zero-stride views.
LAYOUTS_2D = ("C", "F", "neg", "negrow", "negcol", "sub", "step", "offset", "oddbytes",
              "misaligned", "bcast_rows", "bcast_cols")


#: Layouts of any-dimensional operands (batched matmul, 1-D vectors).
LAYOUTS_ND = ("C", "swap", "neg", "step", "offset", "bcast")
#: Layouts a destination may take (writeable ones).
OUT_LAYOUTS_2D = ("C", "F", "neg", "negrow", "sub", "step", "offset", "oddbytes", "misaligned")


_NAN_BYTE = 0xFF        # all-ones bytes are a NaN in float32 and float64 alike


def _parent(shape, dtype):
    """A fresh contiguous buffer of NaN: whatever a layout does not use stays NaN."""
    return np.full(shape, np.nan, dtype)


def _byte_parent(nbytes):
    return np.full(nbytes, _NAN_BYTE, np.uint8)


def layout(shape, dtype, kind):
    """An empty (NaN) array of ``shape`` in memory layout ``kind``: ``(view, parent)``.

    ``parent`` is the contiguous allocation the view lives in (for the before/after
    byte comparisons).  The broadcast layouts are built by :func:`operand`.
    """
    shape = tuple(shape)
    nd = len(shape)
    item = np.dtype(dtype).itemsize
    size = math.prod(shape)
    if kind == "C":
        p = _parent(shape, dtype)
        return p, p
    if kind in ("F", "swap"):       # Fortran order in 2-D; the last two axes swapped in N-D
        if nd < 2:
            return layout(shape, dtype, "C")
        p = _parent(shape[:-2] + shape[:-3:-1], dtype)
        return (p.T if kind == "F" and nd == 2 else np.swapaxes(p, -1, -2)), p
    if kind == "neg":               # every axis reversed
        p = _parent(shape, dtype)
        return p[(slice(None, None, -1),) * nd], p
    if kind == "negrow":
        p = _parent(shape, dtype)
        return p[::-1], p
    if kind == "negcol":
        p = _parent(shape, dtype)
        return p[:, ::-1], p
    if kind == "sub":               # a block of a larger matrix (leading dimension > width)
        p = _parent((shape[0] + 2, shape[1] + 3), dtype)
        return p[1:1 + shape[0], 2:2 + shape[1]], p
    if kind == "step":              # rows 2 apart and columns 3 apart (N-D: last axis by 2)
        if nd == 2:
            p = _parent((2 * shape[0], 3 * shape[1]), dtype)
            return p[::2, ::3], p
        p = _parent(shape[:-1] + (2 * shape[-1],) if nd else (), dtype)
        return (p[..., ::2] if nd else p), p
    if kind == "offset":            # C order one element past an aligned start
        p = _parent(size + 1, dtype)
        return p[1:].reshape(shape), p
    if kind == "misaligned":        # C order one byte past an aligned start
        p = _byte_parent(size * item + 1)
        return np.ndarray(shape, dtype, buffer=p, offset=1), p
    if kind == "oddbytes":          # rows a whole number of elements plus 3 bytes apart
        rs = shape[1] * item + 3
        p = _byte_parent(max(0, shape[0] * rs))
        return np.ndarray(shape, dtype, buffer=p, strides=(rs, item)), p
    raise ValueError(kind)


def operand(rng, shape, dtype, kind, fill):
    """An input: random values (see :func:`values`) in layout ``kind``: ``(view, parent)``.

    The zero-stride (read-only) layouts make the values repeat: ``bcast``/``bcast_rows``
    one row for all rows (N-D: one batch entry for all, 1-D: one value), ``bcast_cols``
    one column for all columns.
    """
    shape = tuple(shape)
    if kind.startswith("bcast") and shape:
        small = (1,) + shape[1:] if kind in ("bcast", "bcast_rows") else shape[:-1] + (1,)
        p = values(rng, small, fill, dtype)
        return np.broadcast_to(p, shape), p
    view, parent = layout(shape, dtype, kind)
    view[...] = values(rng, shape, fill, dtype)
    return view, parent


def snapshot(parent):
    """The bytes of a contiguous allocation, to compare after a call."""
    return parent.reshape(-1).view(np.uint8).copy()


def owned(parent, view):
    """Mask of the bytes of ``parent`` that ``view``'s elements occupy."""
    flat = parent.reshape(-1).view(np.uint8)
    mask = np.zeros(flat.size, np.uint8)
    if view.size:
        twin = np.ndarray(view.shape, np.dtype(f"u{view.itemsize}"), buffer=mask,
                          offset=view.ctypes.data - flat.ctypes.data, strides=view.strides)
        twin[...] = np.iinfo(twin.dtype).max
    return mask != 0


def assert_untouched(parent, before, what, allowed=None):
    """Every byte of ``parent`` equals ``before``, except where ``allowed`` (a mask)."""
    after = parent.reshape(-1).view(np.uint8)
    changed = after != before
    if allowed is not None:
        changed &= ~allowed
    if changed.any():
        where = np.flatnonzero(changed)
        pytest.fail(f"{what}: {where.size} bytes changed outside what may be written, "
                    f"first at byte {where[0]} of its buffer")


Expected = collections.namedtuple("Expected", "ref mag cmag k equal_terms")


Expected.__doc__ = """What a product should be: the value, the magnitudes its error scales with
(``|alpha| |A| @ |B|`` and ``|beta C0|``), k, and where all k terms are equal."""


def equal_terms(a, b):
    """Mask over ``a @ b``: whether each dot product sums k equal terms.

    That is, row i of A and column j of B are each constant along k (NaN counting
    as equal to NaN, as in a broadcast row holding one).  Then the rounding errors
    all have one sign and add up linearly in the length of a block of k;
    otherwise they behave like independent ones, growing as sqrt(k).
    """
    if a.shape[-1] < 2:     # k and sqrt(k) agree
        return np.zeros(np.matmul(np.zeros(a.shape), np.zeros(b.shape)).shape, bool)

    def constant(x, axis):
        first = np.take(x, [0], axis=axis)
        return ((x == first) | (np.isnan(x) & np.isnan(first))).all(axis=axis)

    rows = a if a.ndim > 1 else a[None, :]
    cols = b if b.ndim > 1 else b[:, None]
    same = constant(rows, -1)[..., :, None] & constant(cols, -2)[..., None, :]
    if b.ndim == 1:
        same = same[..., 0]
    if a.ndim == 1:
        same = same[..., 0, :] if b.ndim > 1 else same[..., 0]
    return same


def reference(a, b, alpha=1.0, beta=0.0, c0=None):
    """``alpha * a @ b + beta * c0`` with numpy's matmul semantics, as an :class:`Expected`.

    float64 for float32 results; extended precision for float64 results and when
    NaN/Inf are present (numpy's plain loop: IEEE semantics, no BLAS shortcuts).
    """
    dtype = np.result_type(a, b)
    specials = not (np.isfinite(a).all() and np.isfinite(b).all())
    prec = EXTENDED if (dtype == F64 or specials) else np.float64
    with np.errstate(invalid="ignore"):     # inf * 0, inf - inf: NaN, as it should be
        ref = np.matmul(np.asarray(a, prec), np.asarray(b, prec)) * prec(alpha)
        mag = abs(alpha) * np.matmul(np.abs(np.asarray(a, np.float64)),
                                     np.abs(np.asarray(b, np.float64)))
        cmag = np.zeros_like(mag)
        if c0 is not None and beta != 0:
            ref = ref + prec(beta) * np.asarray(c0, prec)
            cmag = np.abs(beta * np.asarray(c0, np.float64))
    return Expected(np.asarray(ref), np.asarray(mag), np.asarray(cmag), a.shape[-1],
                    np.asarray(equal_terms(a, b)))


def check(got, expected, dtype, what):
    """NaN/Inf exactly where the reference has them; elsewhere within the bound.

    The bound is ``LIMIT * (g eps |alpha||A||B| + eps |beta C0|)`` with g = sqrt(k),
    or g = k where every term of a dot product is the same (:func:`equal_terms`).
    Records the largest error/bound ratio per dtype and growth in :data:`WORST`.
    """
    ref, mag, cmag, k, same = expected
    got = np.asarray(got)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, numpy gives {ref.shape}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, numpy gives {dtype}"
    for name, bad in (("NaN", np.isnan(got) != np.isnan(ref)),
                      ("Inf", (np.isinf(got) | np.isinf(ref)) & (got != ref) & ~np.isnan(got))):
        if bad.any():
            i = tuple(int(x) for x in np.argwhere(bad)[0])
            pytest.fail(f"{what}: {int(bad.sum())} elements differ from numpy in {name}; "
                        f"first at {i}: got {got[i]!r}, expected {ref[i]!r}")
    finite = np.isfinite(ref)
    if not finite.any():
        return
    eps = np.finfo(dtype).eps
    g = np.where(same, max(k, 1), math.sqrt(max(k, 1)))
    unit = (g * eps * mag + eps * cmag + np.finfo(dtype).tiny)[finite]
    err = np.abs(got[finite].astype(ref.dtype) - ref[finite]).astype(np.float64)
    ratios = err / unit
    worst = int(np.argmax(ratios))
    ratio = float(ratios[worst])
    growth = "k" if np.broadcast_to(same, ref.shape)[finite][worst] else "sqrt(k)"
    key = f"{dtype.name}, {growth}"
    with _lock:
        if ratio > WORST.get(key, (-1.0, ""))[0]:
            WORST[key] = (ratio, f"k={k}: {what}")
    if ratio > LIMIT:
        i = tuple(int(x) for x in np.argwhere(finite)[worst])
        pytest.fail(f"{what}: error {err[worst]!r} at {i} is {ratio:.2f}x {growth} eps |A||B| "
                    f"(limit {LIMIT}): got {got[i]!r}, expected {float(ref[i])!r}")
