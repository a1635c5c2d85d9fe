"""The Python side of the GEMM engine: orient the problem, pick a path, own the buffers.

``gemm_into(a, b, c, alpha, beta)`` computes ``c = alpha * a @ b + beta * c`` for
validated 2-D float arrays of one dtype.  It chooses between

* the matrix-vector path when m == 1 or n == 1 (``gemv`` in ``kernels/_tile.py``),
* the unpacked path when B's rows are contiguous and the operands it reuses stay
  in L2: the strided micro-kernel reads A and B in place,
* the five-loop driver over packed panels otherwise.

Threads: when B is the larger side and fits one packed block, and the cores' L2 is
small (:func:`own_b_panels`), the threads pack it together, chunk by chunk from a
counter, and then take MC-row blocks of C from another (``gemm_tasks``); a thread
waits on another only for the chunk of B that one is still packing, and one that
starts late finds the work taken.  Otherwise C is cut into one block per thread
along its longer side (whole MR or NR multiples) and each block runs the serial
path, every thread packing the operand it shares (B for a row split, A for a
column split); when k is long and C has too few tiles for that, or is
far smaller than k, k is cut instead and the partial products are summed at the
end.  Every share goes to the pool as a native share (``kernels/native.py``): a C
function and an argument block the caller writes, which a pool thread runs
without taking the GIL.  This keeps the engine free of Numba's parallel
machinery: no threading-layer constraints on concurrent calls from several Python
threads, and seconds less compile time.
"""
import numpy as np

from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_BIAS_ROW, cdiv, round_up
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.workspace import buffers, share_blocks
from tilegemm.kernels.pool import run_native_shares
from tilegemm.kernels.tiles import PLANS, SMALL_ITEM, item_kernel, kernel_for
from tilegemm.kernels.tiny import BATCH_CALLS, SMALL_CALLS, TINY_CALLS, TINY_DECLINED
from tilegemm.packing import flat_view
from tilegemm.tuning.machine import detect, l1_alias_period
from tilegemm.tuning.peak import nominal_peak_gflops

#: Below this many flops (2*m*n*k) one thread does the whole product: handing work to a
#: pool thread costs more than it saves (figures in docs/kernels.md, Threads).  Changed
#: after products ran (as tests do), call :func:`reset_plans`: ``tilegemm.matmul`` calls
#: the small products it saw run on one thread straight (``kernels.small.one_thread_flops``).
SERIAL_FLOPS = 2 * 176 ** 3
#: ... or below this many seconds of one core at its nominal peak, when that is fewer
#: flops: the handoff costs the same time on a slower core, so it shares smaller products.
SERIAL_SECONDS = 80e-6

#: A matrix-vector product is shared only when its matrix has this many elements per thread.
GEMV_SERIAL_ELEMENTS = 1 << 18

#: Split k among threads only when each slice has at least this many.
SPLIT_K_MIN = 1024
#: ... and C has too few tiles to go round, or k is at least this many times C's
#: longer side.  Cutting C then has every thread pack (or read) all of the long
#: operand for little arithmetic on it; a slice of k per thread halves that.  Measured
#: on a 2-core Zen 3, float32, 2 threads, k slices against the row split:
#: 32x32x32768 2.2x, 64x64x16384 1.23x, 32x32x4096 1.15x; nearer the ratio the gain
#: fades into the noise (96x96x8192 1.14x, 128x128x8192 1.07x, but 64x64x4096
#: 0.85-0.88x, 256x256x16384 0.97x).
SPLIT_K_DEPTH = 128

def reset_plans():
    """Forget cached kernel choices, e.g. after changing ``TILEGEMM_*`` overrides."""
    PLANS.clear()
    SMALL_CALLS.clear()
    TINY_CALLS.clear()
    TINY_DECLINED.clear()
    BATCH_CALLS.clear()
    BLOCKS_PLANS.clear()
    _shared_b_plans.clear()


#: k block of the unpacked path (its tiles read A and B in place, KC columns of A at a time).
UNPACKED_KC = 512

#: Up to this many rows of C the unpacked path ignores how B's rows fall on L1's sets:
#: its panel is re-read from L2 by a few row panels only, and packing, a pass over A
#: and B per use of each value m or n times, costs the more (see fits_unpacked).
UNPACKED_FEW_ROWS = 48

#: Up to this many rows of C the unpacked path streams B: each B panel is read from
#: memory once, by a column of a few tiles, so B's KC block need not fit in L2 (packing
#: it would cost a pass over B per m / MR uses of each value), and KC is cut so that the
#: panel stays in L1 while its column runs (see unpacked_kc; docs/kernels.md, Paths).
STREAM_ROWS = 64

#: Cache bytes the unpacked path may count on (see fits_unpacked); None means the L2 size.
SMALL_BYTES = None


def _small_bytes():
    return detect().l2_bytes if SMALL_BYTES is None else SMALL_BYTES


def gemm_into(a, b, c, alpha=1.0, beta=0.0, bias=None, epi=0, threads=None):
    """``c = alpha * a @ b + beta * c`` (then bias/activation per ``epi``), in place.

    Parameters
    ----------
    a, b, c : ndarray
        2-D arrays of one float dtype, shapes (m, k), (k, n), (m, n), any strides.
        ``c`` must be writeable and must not overlap ``a`` or ``b``.
    alpha, beta : float
    bias : ndarray, optional
        1-D contiguous, length m with ``EPI_BIAS_ROW`` or n with ``EPI_BIAS_COL``.
    epi : int
        Epilogue flags from :mod:`tilegemm.ground.contracts`.
    threads : int, optional
        Defaults to :func:`tilegemm.get_num_threads` (see :mod:`tilegemm.ground.threads`).

    Returns
    -------
    c
    """
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return c
    item = c.itemsize
    c_rs, c_cs = c.strides
    if c_rs % item or c_cs % item:
        # Strides between whole elements: the kernels cannot address C in place.
        tmp = np.array(c, order="C") if beta != 0 else np.empty(c.shape, c.dtype)
        gemm_into(a, b, tmp, alpha, beta, bias, epi, threads)
        c[...] = tmp
        return c
    if c_cs != item and c_rs == item and m > 1:
        # Column-major C: compute C^T = B^T A^T, whose rows are contiguous.
        if epi & (EPI_BIAS_ROW | EPI_BIAS_COL):
            epi ^= EPI_BIAS_ROW | EPI_BIAS_COL
        gemm_into(b.T, a.T, c.T, alpha, beta, bias, epi, threads)
        return c
    if c_cs != item and n > 1:
        # Neither orientation has unit stride: work in a contiguous copy.
        tmp = np.ascontiguousarray(c) if beta != 0 else np.empty(c.shape, c.dtype)
        gemm_into(a, b, tmp, alpha, beta, bias, epi, threads)
        c[...] = tmp
        return c

    dtype = c.dtype
    kern, blk = product_kernel(dtype, m, n)
    # The plan the jitted drivers take whole: (alpha, beta) and each operand as
    # (flat, (offset, row_stride, col_stride)).
    args = (_scalars(dtype, alpha, beta), _operand(a), _operand(b), _operand(c))
    bias = kern.no_bias if bias is None else bias
    # Work in units worth a thread each: GEMV is bound by reading its matrix once; from
    # SERIAL_FLOPS on, a product is shared by two threads (each doing half).
    if m == 1 or n == 1:
        shares = m * n * k // GEMV_SERIAL_ELEMENTS
    else:
        shares = int(2 * (2 * m * n * k) // serial_flops(dtype))
    if threads is None:
        # Only worth asking when the product is big enough to share.
        threads = get_num_threads() if shares >= 2 else 1
    threads = min(threads, max(1, shares))
    if threads <= 1:
        _serial(kern, blk, m, n, k, args, bias, epi)
    else:
        _threaded(kern, blk, m, n, k, args, bias, epi, threads)
    return c


def product_kernel(dtype, m, n):
    """``(kernel, blocking)`` of an m x n product: :func:`kernel_for`'s, unless C is one
    column of tiles (at most ``SMALL_ITEM`` rows) whose rows that tile pads by more
    than a sixth: then the tile chosen for the shape (:func:`item_kernel`; float32
    32x32x32768 on the AVX-512 Xeon, one thread: 14x32 tiles 0.99x numpy, 8x32 1.46x;
    two threads 1.24x -> 1.87x).  The blocking is then the default tile's: MC and NC
    are rounded to whole panels of the kernel's own (:func:`serial_plan`)."""
    kern, blk = kernel_for(dtype, n)
    if m <= SMALL_ITEM and n <= kern.nr and 6 * round_up(m, kern.mr) > 7 * m:
        return item_kernel(dtype, m, n)
    return kern, blk


def serial_flops(dtype):
    """The flops from which a product is shared (``SERIAL_FLOPS``, ``SERIAL_SECONDS``).

    ``SERIAL_SECONDS`` of work at the *base*-clock nominal peak: the threshold was
    tuned with that figure, so it stays on the base clock (``tilegemm info``'s
    nominal peak uses the boost clock where known).
    """
    peak = _nominal_peaks.get(dtype)
    if peak is None:
        peak = _nominal_peaks[dtype] = nominal_peak_gflops(dtype)
    return max(1, min(SERIAL_FLOPS, SERIAL_SECONDS * peak * 1e9))


_nominal_peaks = {}   # per dtype: the machine's, fixed (and a few microseconds to ask)


_UNIT_SCALARS = {np.dtype(t): (t(1), t(0)) for t in (np.float32, np.float64)}


def _scalars(dtype, alpha, beta):
    """``(alpha, beta)`` in ``dtype``; the usual (1, 0) made once."""
    if alpha == 1 and beta == 0:
        unit = _UNIT_SCALARS.get(dtype)
        if unit is not None:
            return unit
    return dtype.type(alpha), dtype.type(beta)


def _operand(x):
    """``(flat, (offset, row_stride, col_stride))``: :func:`tilegemm.packing.flat_view`
    as the jitted drivers take an operand, the C-contiguous case answered inline."""
    if x.flags.c_contiguous and x.size:
        return x.reshape(-1), (0, x.shape[1], 1)
    flat, off, rs, cs = flat_view(x)
    return flat, (off, rs, cs)


#: Every path :func:`route` may name: three serial ones, three that share a product.
SERIAL_ROUTES = ("gemv", "unpacked", "packed")
THREADED_ROUTES = ("split_k", "shared_b", "blocks")


def route(kern, blk, m, n, k, threads=1, b_strides=None):
    """The path a product of m x k by k x n takes on ``threads`` threads.

    The one place the driver decides; tests call it to check a decision and may
    wrap it to observe the paths a call took (the shares of a threaded product ask
    again with ``threads=1`` when its plan is made: ``BLOCKS_PLANS``, ``_split_k``).

    Parameters
    ----------
    kern, blk
        The kernel and blocking of the product (:func:`kernel_for`).
    m, n, k : int
        The product's sizes, m and n at least 1.
    threads : int
        Threads sharing the product; 1 for a serial product.
    b_strides : (int, int), optional
        B's row and column strides in elements; C-contiguous B by default.

    Returns
    -------
    str
        One thread: ``"gemv"`` (m or n is 1), ``"unpacked"`` (B's rows contiguous
        and :func:`fits_unpacked`) or ``"packed"``.  Several: ``"split_k"`` (k is
        long, and C has too few tiles to go round or k is ``SPLIT_K_DEPTH`` times
        C's longer side), ``"shared_b"`` (B the larger side
        and one packed B block, but not one column of tiles over B's contiguous
        rows, and a small L2 (:func:`own_b_panels`): packed once, threads take
        MC-row blocks of C from a counter) or
        ``"blocks"`` (one block of C per thread along its longer side).
    """
    b_rs, b_cs = (n, 1) if b_strides is None else b_strides
    if threads <= 1:
        if m == 1 or n == 1:
            return "gemv"
        return "unpacked" if b_cs == 1 and fits_unpacked(kern, m, n, k, b_rs) else "packed"
    tiles = cdiv(m, kern.mr) * cdiv(n, kern.nr)
    if k >= threads * SPLIT_K_MIN and (tiles < 2 * threads or k >= SPLIT_K_DEPTH * max(m, n)):
        return "split_k"
    by_rows = m / kern.mr >= n / kern.nr
    # Matrix-vector products keep their own path; so does one column of tiles over
    # B's contiguous rows: each share reads its rows of A in place, once (unpacked),
    # where shared_b would pack them all.
    one_column = n <= kern.nr and b_cs == 1
    if (min(m, n) > 1 and by_rows and not one_column and not own_b_panels()
            and k * round_up(n, kern.nr) <= blk.kc * blk.nc):
        return "shared_b"
    return "blocks"


#: From this much private L2 per core, threads sharing a product by rows each pack
#: their own copy of B (``blocks``) rather than read one shared copy (``shared_b``).
#: On a 2-vCPU Xeon with 2 MiB of L2 (AVX-512) blocks ran 1.05-1.33x faster from
#: 192^3 to 2048^3 float32 (the copy each core packs stays in its L2; half the shared
#: copy comes from the other core's); on a Zen 3 with 512 KiB shared_b had won by
#: 1.02-1.11x (256^3-1024^3), its one copy packed by both threads, read from L3.
OWN_B_L2_BYTES = 1 << 20


def own_b_panels():
    """Whether threads sharing a product by rows pack B each (see ``OWN_B_L2_BYTES``;
    a machine whose L2 is not detected counts 1 MiB, and so packs B each)."""
    return detect().l2_bytes >= OWN_B_L2_BYTES


def _serial(kern, blk, m, n, k, args, bias, epi):
    """One thread's product, on the path :func:`route` names, with this thread's buffers."""
    path, blocks, sizes = serial_plan(kern, blk, m, n, k, args[2][1][1:])
    packs = buffers((kern.name, path), sizes, kern.dtype)
    mod = kern.module
    if path == "gemv":       # m == 1 or n == 1: one pass over the matrix operand
        mod.gemv_product((m, n, k), *args, (bias, epi), packs[0])
    elif path == "unpacked":  # the strided kernel on A and B; only edge panels packed
        mod.gemm_small((m, n, k), *args, (bias, epi), blocks[0], packs)
    else:                     # the five loops over packed panels
        mod.gemm_serial((m, n, k), *args, (bias, epi), blocks, packs)


def serial_plan(kern, blk, m, n, k, b_strides):
    """``(path, (KC, MC, NC), buffer sizes)`` of a product on one thread: GEMV's buffer
    is its accumulator, the others' A and B panels."""
    path = route(kern, blk, m, n, k, 1, b_strides)
    if path == "gemv":
        return path, (0, 0, 0), (max(m, n), 1)
    if path == "unpacked":
        KC = unpacked_kc(kern, m, n, k)
        return path, (KC, 0, 0), (kern.mr * KC, kern.nr * KC)
    KC = k_block(k, blk.kc)
    # Whole panels of the kernel's own tile: the packers fill whole MR and NR panels,
    # and a blocking may belong to another tile (product_kernel).
    MC = min(round_up(blk.mc, kern.mr), round_up(m, kern.mr))
    NC = min(round_up(blk.nc, kern.nr), round_up(n, kern.nr))
    return path, (KC, MC, NC), (MC * KC, NC * KC)


#: A k up to this many times the blocking's KC is one k block of the packed path: a
#: second block of the rest costs a pass over every tile of C (loading and storing
#: it, repacking A) for little arithmetic.  On the AVX-512 Xeon (float32, KC 192, one
#: thread, numpy alternated): 256^3 as 192 + 64 ran 0.96x numpy, as one block of 256
#: 1.06x; 320^3 as 192 + 128 1.05x, as two of 160 1.12x (KC 128: three blocks).
KC_STRETCH = 4 / 3


def k_block(k, kc):
    """KC for a packed product of depth k and the blocking's ``kc``: all of k up to
    ``KC_STRETCH * kc``, else ``kc`` evened out so that the k blocks are nearly
    equal, in whole cache lines of float32 (an A panel of MR x 171 started its
    successors mid-line: 512^3 0.97x numpy, 1.07x with 176)."""
    if k <= KC_STRETCH * kc:
        return max(1, k)
    return min(kc, round_up(cdiv(k, cdiv(k, kc)), 16))


def unpacked_kc(kern, m, n, k):
    """KC of the unpacked path for an m x k by k x n product.

    ``UNPACKED_KC``, unless B streams from memory: up to ``STREAM_ROWS`` rows of C
    whose B block of that depth would not fit in half of L2.  Then the block whose B
    panel (KC x NR) takes a third of L1, beside A's rows and the next panel's
    prefetched lines, so that every tile of a column reads it from L1 (float32 6x64
    on a 48 KiB L1: KC 64).
    """
    size = kern.dtype.itemsize
    kc = max(1, min(UNPACKED_KC, k))
    if m <= STREAM_ROWS and kc * n * size > _small_bytes() // 2:
        kc = min(kc, max(16, detect().l1d_bytes // (3 * kern.nr * size)))
    return kc


def fits_unpacked(kern, m, n, k, ldb):
    """Whether to skip packing: one column of tiles, or B's and A's k blocks fit in cache.

    Per KC block the unpacked path walks C by columns of tiles: each B micro-panel
    is read in place down its column and A's block (m x KC) is re-read for every
    column.  With a single column nothing is re-read.  Otherwise both k blocks must
    sit in L2, where B streaming from memory through rows a page or more apart
    would cost more than packing.  A long k alone does not matter, and there
    packing costs most (a pass over A and B for every m or n uses of a value).  Up
    to ``STREAM_ROWS`` rows B is read once in any case: only A's block must fit.
    And the micro-panel's rows, ``ldb`` elements apart, must spread over L1's sets
    (see :func:`~tilegemm.tuning.machine.l1_alias_period`), or every tile down the
    column reloads them from L2 -- unless C has only a few row panels
    (``UNPACKED_FEW_ROWS``).  The measurements behind the rule: docs/kernels.md, Paths.
    """
    if n <= kern.nr:
        return True
    budget = _small_bytes() // 2
    size = kern.dtype.itemsize
    kc = unpacked_kc(kern, m, n, k)
    spread = kc <= detect().l1d_bytes // 4096 * l1_alias_period(ldb * size)
    return ((kc * n * size <= budget or m <= STREAM_ROWS) and m * kc * size <= budget
            and (spread or m <= UNPACKED_FEW_ROWS))


def _threaded(kern, blk, m, n, k, args, bias, epi, threads):
    """Share one product among ``threads`` threads on the path :func:`route` names.

    ``blocks``: C is cut into one block per thread along its longer side, each
    block a serial product (:func:`_blocks_plan`).
    """
    path = route(kern, blk, m, n, k, threads, args[2][1][1:])
    if path == "split_k":
        _split_k(kern, blk, m, n, k, args, bias, epi, threads)
        return
    if path == "shared_b":
        _shared_b(kern, blk, m, n, k, args, bias, epi, threads)
        return
    _run_serial_shares(kern, _blocks_plan(kern, blk, m, n, k, args, epi, threads), args,
                       (bias, epi))


def _run_serial_shares(kern, made, args, epilogue):
    """Run the serial shares ``made = (reader, plan, sizes)`` (:func:`_share_plan`) of
    the product ``args`` at once, as native shares: every argument block written by
    one jitted call (``serial_blocks`` in ``kernels/_tile_shares.py``), with buffers
    the caller holds for them."""
    kind, plan, sizes = made
    mod = kern.shares
    packs = buffers((kern.name, "blocks", len(plan)), sizes, kern.dtype)
    block, rows = share_blocks("serial", len(plan), mod.SERIAL_SLOTS)
    mod.serial_blocks(block, plan, *args, epilogue, packs)
    run_native_shares(mod.share_address(kind), rows)


def _share_plan(kern, blk, shares, b_strides):
    """``(reader, plan, buffer sizes)`` of serial shares ``(shape, shifts of A's, B's
    and C's offsets, bias shift)``: each on the serial path :func:`route` names, its
    row of ``plan`` as ``serial_blocks`` takes it."""
    rows, sizes, paths = [], [], set()
    for shape, shifts, bias_shift in shares:
        path, blocks, share_sizes = serial_plan(kern, blk, *shape, b_strides)
        # The row names the path by the shares module's code for it (GEMV, ...).
        rows.append((getattr(kern.shares, path.upper()), *shape, *shifts, bias_shift, *blocks))
        sizes += share_sizes
        paths.add(path)
    # Shares on one path run that path's reader, which compiles only its driver.
    kind = "serial_" + paths.pop() if len(paths) == 1 else "serial"
    return kind, np.array(rows, np.int64), sizes


def _blocks_plan(kern, blk, m, n, k, args, epi, threads):
    """``(reader, plan, buffer sizes)`` of the ``blocks`` route (``serial_blocks`` in
    ``kernels/_tile_shares.py``), worked out once per shape, strides and threads:
    its Python cost was twice a 2-thread launch's."""
    strides = tuple(x[1][1:] for x in args[1:])
    key = (kern.name, (blk.kc, blk.mc, blk.nc), SMALL_BYTES, m, n, k, strides,
           epi & (EPI_BIAS_ROW | EPI_BIAS_COL), threads)
    made = BLOCKS_PLANS.get(key)
    if made is None:
        (a_rs, a_cs), (b_rs, b_cs), (c_rs, c_cs) = strides
        by_rows = m / kern.mr >= n / kern.nr
        unit, length = (kern.mr, m) if by_rows else (kern.nr, n)
        step = round_up(cdiv(length, threads), unit)
        flag = EPI_BIAS_ROW if by_rows else EPI_BIAS_COL
        shares = [((min(step, length - s), n, k), (s * a_rs, 0, s * c_rs), s if epi & flag else 0)
                  if by_rows else
                  ((m, min(step, length - s), k), (0, s * b_cs, s * c_cs), s if epi & flag else 0)
                  for s in range(0, length, step)]
        if len(BLOCKS_PLANS) >= 1024:          # bounded: shapes come and go
            BLOCKS_PLANS.clear()
        made = BLOCKS_PLANS[key] = _share_plan(kern, blk, shares, (b_rs, b_cs))
    return made


#: ``_blocks_plan``'s plans by kernel, blocking, ``SMALL_BYTES``, shape, strides, bias
#: and threads; its shares' serial paths (:func:`route`) are decided when a plan is
#: made.  After changing the path rules' other constants, :func:`reset_plans`.
BLOCKS_PLANS = {}


def _shared_b(kern, blk, m, n, k, args, bias, epi, threads):
    """Share a product whose packed B fits one B block among threads, B packed once.

    The threads pack B together, then take MC-row blocks of C from a counter
    (``gemm_tasks`` in ``kernels/_tile.py``).  Cutting C into one fixed block per
    thread instead has every thread pack all of B, and leaves the caller idle at
    the end by however late a pool thread started.  Measured on a 2-core Zen 3
    against that, with B packed by the caller alone (2 threads, median of 7
    alternated rounds, two runs): 256^3 1.08-1.11x, 768^3 1.05x, 2048x1024x256
    1.08x, 384^3-1024^3 1.02-1.03x.  Packing B together rather than by the caller
    alone (each other thread packing a copy of its own when it came before B was
    ready) halves each thread's packing: 1024^3 in two A/B rounds on the same host,
    best of 45 calls, 167-175 against 163-164 GFLOPS.
    """
    blocks, chunks, (b_len, a_len) = _shared_b_plan(kern, (blk.kc, blk.mc, blk.nc), m, n, k,
                                                    threads)
    mod = kern.shares
    counter = np.zeros(1, np.int64)                 # C's tasks
    flags = np.zeros(1 + chunks, np.int64)          # B's chunks: handed out, packed
    (scratch,) = buffers((kern.name, "shared_b"), (b_len + threads * a_len,), kern.dtype)
    block, rows = share_blocks("shared_b", threads, mod.SHARED_B_SLOTS)
    mod.shared_b_blocks(block, counter, flags, (m, n, k), *args, (bias, epi), blocks,
                        (scratch, b_len, a_len))
    run_native_shares(mod.share_address("gemm_tasks"), rows)


def _shared_b_plan(kern, cache_blocks, m, n, k, threads):
    """``((KC, MC, NC), chunks, (b_len, a_len))`` of :func:`_shared_b` for one shape,
    worked out once: B's packing chunks, the packed B's length and each share's A
    block's in the scratch buffer (whole cache lines)."""
    key = (kern.name, cache_blocks, m, n, k, threads)
    plan = _shared_b_plans.get(key)
    if plan is None:
        kc, mc, nc = cache_blocks
        KC = k_block(k, kc)
        NC = min(round_up(nc, kern.nr), round_up(n, kern.nr))
        MC = balanced_rows(m, mc, kern.mr, threads)
        chunks = kern.module.pack_chunks(n, k, KC, NC)[0]
        _, b_len, a_len = kern.shares.scratch_sizes(1, max(1, k * round_up(n, kern.nr)), MC * KC)
        if len(_shared_b_plans) >= 1024:       # bounded: shapes come and go
            _shared_b_plans.clear()
        plan = _shared_b_plans[key] = ((KC, MC, NC), chunks, (b_len, a_len))
    return plan


_shared_b_plans = {}


#: Below this many of the cache's row blocks per thread, shared_b evens them out.
BALANCE_BLOCKS = 3


def balanced_rows(m, mc, mr, threads):
    """The MC of m rows shared by ``threads`` threads taking row blocks from a counter.

    The cache's ``mc``, unless that makes fewer than ``BALANCE_BLOCKS`` blocks a
    thread: then the largest MC up to it that cuts m into a multiple of ``threads``
    blocks of nearly equal rows (whole MR panels).  With few blocks the cache's MC
    leaves a short last one, and the threads' shares differ by a block: on an
    AVX-512 Xeon (float32 6x64, MC 126, two threads) 384 rows went as 126 + 126
    against 126 + 6 (384^3: 418 -> 348 us balanced, 512^3 841 -> 817).  With many,
    a thread that took the short block takes another, and the smaller blocks cost
    more than they even out (768^3 2539 -> 2617 us, 1024^3 5880 -> 6052)."""
    mc = round_up(mc, mr)          # whole panels (the blocking may be another tile's)
    if cdiv(m, mc) >= BALANCE_BLOCKS * threads:
        return min(mc, round_up(m, mr))
    blocks = round_up(cdiv(m, mc), threads)
    return min(mc, round_up(cdiv(m, blocks), mr))


def _split_k(kern, blk, m, n, k, args, bias, epi, threads):
    """Each thread multiplies a slice of k into its own partial C; one pass sums them into C.

    For products like 32x32x32768, whose C has fewer tiles than there are threads.
    """
    (alpha, beta), a, b, (cf, (c_off, c_rs, _)) = args
    unit = (kern.dtype.type(1), kern.dtype.type(0))
    step = round_up(cdiv(k, threads), 8)
    parts = np.empty((cdiv(k, step), m * n), kern.dtype)
    # Share t: k0 = t * step on, into its own part (row t of parts).
    shares = [((m, n, min(step, k - k0)), (k0 * a[1][2], k0 * b[1][1], t * m * n), 0)
              for t, k0 in enumerate(range(0, k, step))]
    made = _share_plan(kern, blk, shares, b[1][1:])
    _run_serial_shares(kern, made, (unit, a, b, (parts.reshape(-1), (0, n, 1))),
                       (kern.no_bias, 0))
    kern.module.sum_parts(m, n, parts, alpha, beta, cf, c_off, c_rs, bias, epi)
