"""Template for the code bound to one micro-kernel: macro-kernel, edge tiles, five-loop drivers.

``tilegemm.kernels.registry`` writes one module per (dtype, MR, NR, ISA) from this
file, with the configuration block below filled in, so that MR and NR are
compile-time constants and Numba can cache each module's machine code in its own
file.  Read it as the GEMM algorithm; it is also importable as is (float32 6x64).

The matrix-vector path (m == 1 or n == 1) lives here too, on the dot/axpy
blocks of ``kernels/gemv.py``, at the end of the file.

Loops, outermost first (BLIS names):
    jc  over n in steps of NC   -- a KC x NC panel of B is packed once per (jc, pc)
    pc  over k in steps of KC   -- beta on the first pc only, the epilogue on the last
    ic  over m in steps of MC   -- an MC x KC block of A is packed
    jr  over nc in steps of NR  -- the B micro-panel stays in L1 across ...
    ir  over mc in steps of MR  -- ... every A micro-panel: one micro-kernel call
"""
import numba
import numpy as np

from tilegemm.ground.contracts import (EPI_BIAS_COL, EPI_BIAS_ROW, EPI_RELU, EPI_RELU6, JIT, imax,
                                       imin, inner_jit, jit)
from tilegemm.kernels.gemv import GEMV_PREFETCH, make_gemv_kernels
from tilegemm.kernels.microkernel import Flavour
from tilegemm.kernels.native import (as_c_order, borrowed, data_address, flat_view,
                                     tiny_operands)
from tilegemm.kernels.packers import make_pack_panel
from tilegemm.kernels.registry import microkernel
from tilegemm.kernels.sync import acquire, next_task, pause, publish

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
LANES = 16
ISA = "avx512"
# --- end configuration ---

# Declared last-needed first: a cold process's helper compiles the latest first, and
# the packed GEMM runs the packed pair.  Edge flavours read full (zero-padded)
# panels and touch only the valid corner of C.
ukernel_strided = microkernel(DTYPE, ISA, MR, NR, Flavour.STRIDED)
ukernel_strided_edge = microkernel(DTYPE, ISA, MR, NR, Flavour.STRIDED_EDGE)
ukernel_edge = microkernel(DTYPE, ISA, MR, NR, Flavour.EDGE)
ukernel = microkernel(DTYPE, ISA, MR, NR, Flavour.PACKED)
gemv_dot, gemv_axpy = make_gemv_kernels(DTYPE, LANES, prefetch=GEMV_PREFETCH[ISA])
gemv_dot1, _ = make_gemv_kernels(DTYPE, LANES, rows=1, prefetch=GEMV_PREFETCH[ISA])
NO_BIAS = np.zeros(max(MR, NR), DTYPE)
# Elements per cache line, and lines per row of a B micro-panel: the strided kernel's
# prefetches of the next column of tiles go one line per tile (see small_tiles).
LINE = 64 // np.dtype(DTYPE).itemsize
PANEL_LINES = max(1, NR // LINE)
# The packers' inner copies, in vector IR (tilegemm.packing.pack has the same layouts
# in plain Numba, as the reference).
pack_a_panel = make_pack_panel(DTYPE, MR, LANES)
pack_b_panel = make_pack_panel(DTYPE, NR, LANES)
#: A constant 0 or 1 passed to another jitted function is typed ``Literal[int]`` and
#: compiles that function again, once per pattern of literal arguments; ``ZERO`` is
#: typed intp, as Python ints and computed offsets are, so every caller shares one
#: compiled version.  The same holds inside a tuple: ``(0, k, 1)`` is typed apart from
#: ``(ZERO, k, UNIT)``.
ZERO, UNIT = np.intp(0), np.intp(1)
#: For loops over many small products that allocate nothing: without Numba's reference
#: counting, the tuples of arrays built per product cost no atomic increments.
JIT_NO_NRT = dict(JIT, _nrt=False)


@numba.njit(inline='always', **JIT)
def pack_a(a, off, rs, cs, mc, kc, buf):
    """Pack an ``mc x kc`` block of A into ``ceil(mc/MR)`` MR-row micro-panels at ``buf[0:]``."""
    for ir in range(0, mc, MR):
        pack_a_panel(kc, a, off + ir * rs, rs, cs, imin(MR, mc - ir), buf, ir * kc)


@numba.njit(inline='always', **JIT)
def pack_b(b, off, rs, cs, kc, nc, buf):
    """Pack a ``kc x nc`` block of B into ``ceil(nc/NR)`` NR-column micro-panels at ``buf[0:]``."""
    for jr in range(0, nc, NR):
        pack_b_panel(kc, b, off + jr * cs, cs, rs, imin(NR, nc - jr), buf, jr * kc)


@numba.njit(inline='always', **JIT)
def bias_offset(epi, row, col):
    """Where a tile's bias starts: its first row's (EPI_BIAS_ROW) or first column's."""
    if epi & EPI_BIAS_ROW:
        return row
    if epi & EPI_BIAS_COL:
        return col
    return 0


@numba.njit(inline='always', **JIT)
def macro_kernel(shape, apack, a_base, bpack, b_base, c, c_off, ldc, scal, epilogue, origin):
    """The jr and ir loops over one packed A block and ``nc`` columns of the packed B panel.

    ``shape`` is ``(mc, nc, kc)``, ``scal`` ``(alpha, beta)``, ``epilogue``
    ``(bias, epi)``.  ``apack[a_base:]`` is the A block, ``bpack[b_base:]`` this
    call's first B micro-panel; C's tile origin is ``c[c_off]``, rows ``ldc`` apart.
    ``origin`` ``(row0, col0)`` is the global row and column of that origin (they
    index the bias).  Partial tiles at the bottom and right run the edge kernel,
    which touches only their valid corner of C.
    """
    mc, nc, kc = shape
    alpha, beta = scal
    bias, epi = epilogue
    row0, col0 = origin
    for jr in range(0, nc, NR):
        nr = imin(NR, nc - jr)
        for ir in range(0, mc, MR):
            mr = imin(MR, mc - ir)
            c_tile = c_off + ir * ldc + jr
            bias_off = bias_offset(epi, row0 + ir, col0 + jr)
            if mr == MR and nr == NR:
                ukernel(kc, apack, a_base + ir * kc, bpack, b_base + jr * kc, c, c_tile, ldc,
                        alpha, beta, bias, bias_off, epi)
            else:
                ukernel_edge(kc, apack, a_base + ir * kc, bpack, b_base + jr * kc, c, c_tile, ldc,
                             alpha, beta, bias, bias_off, epi, mr, nr)


@jit
def gemm_serial(shape, scal, a, b, c, epilogue, blocks, packs):
    """``C = alpha*A@B + beta*C`` (+ epilogue) on one thread.

    ``shape`` is ``(m, n, k)``, ``scal`` ``(alpha, beta)``, ``epilogue`` ``(bias,
    epi)``, ``blocks`` ``(KC, MC, NC)``.  Each operand ``a``, ``b``, ``c`` is
    ``(flat, (offset, row_stride, col_stride))`` in elements (``packing.flat_view``);
    C's columns are contiguous (its column stride is not read).  ``packs`` is
    ``(apack, bpack)``: ``apack`` >= MC*KC rounded to MR panels, ``bpack`` >= KC*NC
    rounded to NR panels.
    """
    five_loops(shape, scal, a, b, c, epilogue, blocks, packs)


@numba.njit(inline='always', **JIT)
def five_loops(shape, scal, a, b, c, epilogue, blocks, packs):
    """The body of :func:`gemm_serial` (arguments as there), inlined where another
    jitted driver runs the packed loops itself (``matmul_small_packed``)."""
    m, n, k = shape
    alpha, beta = scal
    a, (a_off, a_rs, a_cs) = a
    b, (b_off, b_rs, b_cs) = b
    c, (c_off, ldc, _) = c
    bias, epi = epilogue
    KC, MC, NC = blocks
    apack, bpack = packs
    for jc in range(0, n, NC):
        nc = imin(NC, n - jc)
        # k == 0 still makes one pass (kc = 0) so beta and the epilogue are applied.
        for pc in range(0, imax(k, 1), KC):
            kc = imin(KC, k - pc)
            pack_b(b, b_off + pc * b_rs + jc * b_cs, b_rs, b_cs, kc, nc, bpack)
            beta_pc = beta if pc == 0 else DTYPE(1)
            epi_pc = epi if pc + KC >= k else 0
            for ic in range(0, m, MC):
                mc = imin(MC, m - ic)
                pack_a(a, a_off + ic * a_rs + pc * a_cs, a_rs, a_cs, mc, kc, apack)
                macro_kernel((mc, nc, kc), apack, ZERO, bpack, ZERO, c, c_off + ic * ldc + jc, ldc,
                             (alpha, beta_pc), (bias, epi_pc), (ic, jc))


#: Columns of one chunk of B that a thread packs for all (:func:`pack_b_together`), in
#: micro-panels: small enough that the threads end their packing together, large
#: enough that claiming a chunk costs nothing beside packing it.
PACK_CHUNK_PANELS = 8


@numba.njit(**JIT)
def pack_chunks(n, k, KC, NC):
    """``(chunks, pieces, k_blocks)``: B's packing cut into chunks of
    ``PACK_CHUNK_PANELS`` micro-panels, ``pieces`` of them across each NC block
    (the widest's), in ``k_blocks`` KC blocks of each."""
    width = PACK_CHUNK_PANELS * NR
    pieces = (imin(NC, n) + width - 1) // width
    k_blocks = (k + KC - 1) // KC
    return ((n + NC - 1) // NC) * k_blocks * pieces, pieces, k_blocks


@numba.njit(inline='always', **JIT)
def pack_b_together(n, k, b, b_off, b_rs, b_cs, KC, NC, bpack, flags):
    """Pack all of B into ``bpack`` with every thread that calls this at once, and
    return when all of it is packed.  Block (jc, pc) starts at
    ``jc*k + pc*round_up(nc, NR)``, its micro-panels one after another.

    ``flags[0]`` hands out the chunks (:func:`pack_chunks`); ``flags[1 + i]`` is
    :func:`publish`-ed once chunk i is packed.  A thread packs chunks until none
    is left, then waits only for those another thread is still packing: one
    chunk each at most, and none when it came late and found all of B packed.
    """
    chunks, pieces, k_blocks = pack_chunks(n, k, KC, NC)
    width = PACK_CHUNK_PANELS * NR
    while True:
        chunk = next_task(flags)
        if chunk >= chunks:
            break
        j0 = (chunk % pieces) * width
        pc = (chunk // pieces) % k_blocks * KC
        jc = (chunk // (pieces * k_blocks)) * NC
        nc = imin(NC, n - jc)
        if j0 < nc:                  # the last NC block may have fewer pieces
            kc = imin(KC, k - pc)
            ncp = (nc + NR - 1) // NR * NR
            pack_b(b, b_off + pc * b_rs + (jc + j0) * b_cs, b_rs, b_cs, kc, imin(width, nc - j0),
                   bpack[jc * k + pc * ncp + j0 * kc:])
        publish(flags, 1 + chunk, 1)
    for chunk in range(chunks):
        while acquire(flags, 1 + chunk) == 0:
            pause()


@inner_jit
def gemm_tasks(counter, flags, shape, scal, a, b, c, epilogue, blocks, packs):
    """One thread's part of a product shared through one packed copy of B.

    Arguments as for :func:`gemm_serial`, except ``packs``: ``(apack, bpack)``, the
    latter shared by every thread.  The threads pack B together first
    (:func:`pack_b_together`, ``flags``); then tasks (an MC-row block of C in an
    NC-column block, over all of k) are taken from ``counter``, so a thread that
    starts late takes fewer.  Each task packs its own A blocks: A and B are each
    packed once in all, B by all the threads together.
    """
    m, n, k = shape
    alpha, beta = scal
    a, (a_off, a_rs, a_cs) = a
    b, (b_off, b_rs, b_cs) = b
    c, (c_off, ldc, _) = c
    bias, epi = epilogue
    KC, MC, NC = blocks
    apack, bsrc = packs
    pack_b_together(n, k, b, b_off, b_rs, b_cs, KC, NC, bsrc, flags)
    blocks_m = (m + MC - 1) // MC
    ntasks = blocks_m * ((n + NC - 1) // NC)
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        ic = (task % blocks_m) * MC
        jc = (task // blocks_m) * NC
        mc = imin(MC, m - ic)
        nc = imin(NC, n - jc)
        ncp = (nc + NR - 1) // NR * NR
        # k == 0 still makes one pass (kc = 0) so beta and the epilogue are applied.
        for pc in range(0, imax(k, 1), KC):
            kc = imin(KC, k - pc)
            pack_a(a, a_off + ic * a_rs + pc * a_cs, a_rs, a_cs, mc, kc, apack)
            macro_kernel((mc, nc, kc), apack, ZERO, bsrc, jc * k + pc * ncp, c,
                         c_off + ic * ldc + jc, ldc, (alpha, beta if pc == 0 else DTYPE(1)),
                         (bias, epi if pc + KC >= k else 0), (ic, jc))


@numba.njit(inline='always', **JIT)
def small_tiles(first, last, shape, scal, a, b, c, epilogue, packs):
    """Tiles ``first..last-1`` (numbered down each column of tiles) of the unpacked product.

    Arguments as for :func:`gemm_small` (``shape``'s k is this KC block's).  Full
    tiles run the strided kernel straight on A and B; an edge tile takes its
    partial operand from the edge panel :func:`gemm_small` packed into apack/bpack.
    The i-th tile of a column prefetches line ``i % PANEL_LINES`` of each B row
    of the next column, so that column's first tile finds its B panel in cache.
    """
    m, n, k = shape
    alpha, beta = scal
    a, (a_off, a_rs, a_cs) = a
    b, (b_off, b_rs, _) = b
    c, (c_off, ldc, _) = c
    bias, epi = epilogue
    apack, bpack = packs
    tiles_m = (m + MR - 1) // MR
    for t in range(first, last):
        jr = (t // tiles_m) * NR
        ir = (t % tiles_m) * MR
        nr = imin(NR, n - jr)
        mr = imin(MR, m - ir)
        c_tile = c_off + ir * ldc + jr
        a_tile = a_off + ir * a_rs
        bias_off = bias_offset(epi, ir, jr)
        if mr == MR and nr == NR:
            ukernel_strided(k, a, a_tile, a_rs, a_cs, b, b_off + jr, b_rs, c, c_tile, ldc,
                            alpha, beta, bias, bias_off, epi,
                            NR + (t % tiles_m) % PANEL_LINES * LINE)
        elif mr == MR:
            ukernel_strided_edge(k, a, a_tile, a_rs, a_cs, bpack, 0, NR, c, c_tile, ldc,
                                 alpha, beta, bias, bias_off, epi, mr, nr)
        elif nr == NR:
            ukernel_strided_edge(k, apack, 0, 1, MR, b, b_off + jr, b_rs, c, c_tile, ldc,
                                 alpha, beta, bias, bias_off, epi, mr, nr)
        else:
            ukernel_edge(k, apack, 0, bpack, 0, c, c_tile, ldc, alpha, beta, bias, bias_off,
                         epi, mr, nr)


@numba.njit(inline='always', **JIT)
def gemm_small(shape, scal, a, b, c, epilogue, KC, packs):
    """``C = alpha*A@B + beta*C`` without packing: the kernels read A and B in place.

    Arguments as for :func:`gemm_serial`, with one k block ``KC``.
    For products whose reused operands sit in cache anyway.  k is still cut into
    KC blocks (beta on the first, the epilogue on the last) so that the B rows
    and A columns a block touches stay in L1/L2 however long k is.  B's columns
    must be contiguous (``b_cs == 1``, ``b_rs`` its row stride).  Only the last
    ``m % MR`` rows of A and ``n % NR`` columns of B are packed, zero padded,
    into ``packs`` ``(apack, bpack)`` (MR*KC and NR*KC).
    """
    m, n, k = shape
    alpha, beta = scal
    af, (a_off, a_rs, a_cs) = a
    bf, (b_off, b_rs, b_cs) = b
    bias, epi = epilogue
    apack, bpack = packs
    m_full = m - m % MR
    n_full = n - n % NR
    tiles = ((m + MR - 1) // MR) * ((n + NR - 1) // NR)
    for pc in range(0, imax(k, 1), KC):
        kc = imin(KC, k - pc)
        a_pc = a_off + pc * a_cs
        b_pc = b_off + pc * b_rs
        if m_full < m:
            pack_a(af, a_pc + m_full * a_rs, a_rs, a_cs, m - m_full, kc, apack)
        if n_full < n:
            pack_b(bf, b_pc + n_full * b_cs, b_rs, b_cs, kc, n - n_full, bpack)
        beta_pc = beta if pc == 0 else DTYPE(1)
        epi_pc = epi if pc + KC >= k else 0
        small_tiles(ZERO, tiles, (m, n, kc), (alpha, beta_pc), (af, (a_pc, a_rs, a_cs)),
                    (bf, (b_pc, b_rs, b_cs)), c, (bias, epi_pc), packs)


@numba.njit(inline='always', **JIT)
def overlap(x, y):
    """Whether the C-contiguous arrays ``x`` and ``y`` share memory (their byte ranges
    meet): what ``np.may_share_memory`` says of them, without its Python call."""
    x0, y0 = data_address(x), data_address(y)
    return x0 < y0 + y.size * y.itemsize and y0 < x0 + x.size * x.itemsize


@jit
def matmul_small(a, b, c, plan):
    """``c = a @ b`` for small 2-D operands, in one call from Python: True after it,
    False (nothing computed) unless all three are C-contiguous and aligned and ``c``
    has the product's shape.

    A and B read in place, ``plan = (KC, 0, 0)``: k blocks of KC; the scratch panels
    of the edges are allocated here.  For products of a few microseconds the
    Python-side bookkeeping of the general entry costs more than the arithmetic.
    Compiled also for operands typed of any layout, the entry ``tilegemm.matmul``
    calls straight by shape (``kernels/tiny.py``): the layout checked here takes
    nanoseconds, Python's look at the arrays' flags took a 4x4 product's time.
    A C that shares memory with A or B is computed in a temporary, then copied.
    Assumes m, n >= 2 and matching shapes of A and B.
    """
    a, b, c = borrowed(a), borrowed(b), borrowed(c)
    if not tiny_operands(a, b, c):
        return False
    m, k = a.shape
    n = b.shape[1]
    kc = imax(1, imin(plan[0], k))
    dst, av, bv, cv = one_call_operands(a, b, c)
    if m % MR or n % NR:
        packs = (np.empty(MR * kc, DTYPE), np.empty(NR * kc, DTYPE))
    else:           # no edge panels: no allocation (a product of a few tiles shows it)
        packs = (av[0][:0], av[0][:0])
    gemm_small((m, n, k), (DTYPE(1), DTYPE(0)), av, bv, cv, (NO_BIAS, ZERO), kc, packs)
    copy_back(dst, c)
    return True


@jit
def matmul_small_packed(a, b, c, plan):
    """:func:`matmul_small` over packed panels, ``plan = (KC, MC, NC)`` its blocks (a
    function of its own: a product in place never compiles the packed loops)."""
    a, b, c = borrowed(a), borrowed(b), borrowed(c)
    if not tiny_operands(a, b, c):
        return False
    m, k = a.shape
    n = b.shape[1]
    KC, MC, NC = plan
    kc = imax(1, imin(KC, k))
    dst, av, bv, cv = one_call_operands(a, b, c)
    packs = (np.empty(MC * kc, DTYPE), np.empty(NC * kc, DTYPE))
    five_loops((m, n, k), (DTYPE(1), DTYPE(0)), av, bv, cv, (NO_BIAS, ZERO), (kc, MC, NC), packs)
    copy_back(dst, c)
    return True


@numba.njit(inline='always', **JIT)
def one_call_operands(a, b, c):
    """``(dst, a, b, c)`` of a one-call product (operands checked C-ordered, typed of
    any layout): C itself, or a temporary where C shares memory with A or B, and the
    three as the drivers take an operand."""
    m, k = a.shape
    n = b.shape[1]
    dst = np.empty((m, n), DTYPE) if overlap(c, a) or overlap(c, b) else as_c_order(c)
    return (dst, (flat_view(a), (ZERO, k, UNIT)), (flat_view(b), (ZERO, n, UNIT)),
            (flat_view(dst), (ZERO, n, UNIT)))


@numba.njit(inline='always', **JIT)
def copy_back(dst, c):
    """C's values from the temporary ``dst`` (nothing when ``dst`` is C).  ``dst``'s
    items through ``reshape``, which counts a reference: a borrowed view would let
    Numba free the temporary after its last named use, before the copy."""
    if data_address(dst) != data_address(c):
        flat, src = flat_view(c), dst.reshape(-1)
        for i in range(src.size):
            flat[i] = src[i]


@jit
def sum_parts(m, n, parts, alpha, beta, c, c_off, ldc, bias, epi):
    """C = alpha * sum(parts) + beta * C, then the epilogue: the end of a k split among threads.

    ``parts[t]`` holds thread t's ``m x n`` partial product, row-major.
    """
    for i in range(m):
        for j in range(n):
            s = DTYPE(0)
            for t in range(parts.shape[0]):
                s += parts[t, i * n + j]
            x = alpha * s
            if beta != 0:
                x += beta * c[c_off + i * ldc + j]
            c[c_off + i * ldc + j] = apply_epilogue(x, bias, i if epi & EPI_BIAS_ROW else j, epi)


# ---------------------------------------------------------------- matrix-vector path
# Packing would copy the whole matrix to use one row or column of each tile, so
# GEMMs with m == 1 or n == 1 bypass the engine: y = alpha * M @ x + beta * y
# streams M once, in whichever order its strides make contiguous.

@numba.njit(inline="always", **JIT)
def apply_epilogue(x, bias, bias_idx, epi):
    """Bias and activation on one value (scalar twin of the micro-kernel epilogue)."""
    if epi & (EPI_BIAS_ROW | EPI_BIAS_COL):
        x += bias[bias_idx]
    if epi & (EPI_RELU | EPI_RELU6) and x < 0:
        x = 0
    if epi & EPI_RELU6 and x > 6:
        x = 6
    return x


@inner_jit
def dot_rows(rows, k, m, m_off, m_rs, x, x_off, acc):
    """acc[i] = M[i, :] . x for rows-contiguous M and contiguous x.

    Four rows at a time through the vector-IR ``gemv_dot`` (each load of x feeds
    four rows), the last ``k % LANES`` columns and ``rows % 4`` rows in plain loops.
    """
    kv = k - k % LANES
    i = 0
    while i + 4 <= rows:
        gemv_dot(kv, m, m_off + i * m_rs, m_rs, x, x_off, acc, i)
        for r in range(i, i + 4):
            acc[r] += _dot_tail(m, m_off + r * m_rs, x, x_off, kv, k)
        i += 4
    for r in range(i, rows):
        base = m_off + r * m_rs
        gemv_dot1(kv, m, base, m_rs, x, x_off, acc, r)
        acc[r] += _dot_tail(m, base, x, x_off, kv, k)


@numba.njit(inline="always", **JIT)
def _dot_tail(m, base, x, x_off, start, stop):
    """sum(m[base + p] * x[x_off + p] for p in start..stop-1), in a register."""
    s = DTYPE(0)
    for p in range(start, stop):
        s += m[base + p] * x[x_off + p]
    return s


@inner_jit
def axpy_columns(rows, k, m, m_off, m_cs, x, x_off, x_s, acc):
    """acc = M @ x for columns-contiguous M: four whole columns per pass over acc."""
    for i in range(rows):
        acc[i] = 0
    nv = rows - rows % LANES
    p = 0
    while p + 4 <= k:
        gemv_axpy(nv, m, m_off + p * m_cs, m_cs, x, x_off + p * x_s, x_s, acc, 0)
        for i in range(nv, rows):
            s = acc[i]
            for c in range(p, p + 4):
                s += m[m_off + c * m_cs + i] * x[x_off + c * x_s]
            acc[i] = s
        p += 4
    for q in range(p, k):
        base = m_off + q * m_cs
        xq = x[x_off + q * x_s]
        for i in range(rows):
            acc[i] += m[base + i] * xq


@jit
def gemv(shape, scal, mat, x, y, epilogue, bias_row, acc):
    """``y = alpha * M @ x + beta * y`` with M ``rows x k`` and an optional epilogue.

    ``shape`` is ``(rows, k)``, ``scal`` ``(alpha, beta)``, ``epilogue`` ``(bias,
    epi)``.  ``mat`` is ``(flat, (offset, row_stride, col_stride))``, the vectors
    ``x`` and ``y`` ``(flat, (offset, stride))``.  ``bias_row`` says whether the bias
    is indexed by the row of y (else it has one value, at index 0 -- the other
    GEMM dimension is 1).  ``acc`` holds ``rows`` elements of scratch.  Reads y
    only when ``beta != 0``.
    """
    rows, k = shape
    alpha, beta = scal
    m, (m_off, m_rs, m_cs) = mat
    x, (x_off, x_s) = x
    y, (y_off, y_s) = y
    bias, epi = epilogue
    if m_cs == 1 and x_s == 1:
        dot_rows(rows, k, m, m_off, m_rs, x, x_off, acc)
    elif m_rs == 1 and rows > 1:
        axpy_columns(rows, k, m, m_off, m_cs, x, x_off, x_s, acc)
    else:
        # Neither layout is contiguous: plain strided dot products.
        for i in range(rows):
            s = DTYPE(0)
            base = m_off + i * m_rs
            for p in range(k):
                s += m[base + p * m_cs] * x[x_off + p * x_s]
            acc[i] = s
    for i in range(rows):
        v = alpha * acc[i]
        if beta != 0:
            v += beta * y[y_off + i * y_s]
        y[y_off + i * y_s] = apply_epilogue(v, bias, i if bias_row else 0, epi)


@jit
def gemv_product(shape, scal, a, b, c, epilogue, acc):
    """A product with m == 1 or n == 1 as :func:`gemv` takes it: arguments as for
    :func:`gemm_serial`, ``acc`` ``max(m, n)`` elements of scratch.  n == 1: y (m) =
    A @ b[:, 0]; else y (n) = B^T @ a[0, :], on B's transposed view."""
    m, n, k = shape
    af, (a_off, a_rs, a_cs) = a
    bf, (b_off, b_rs, b_cs) = b
    cf, (c_off, c_rs, _) = c
    epi = epilogue[1]
    if n == 1:
        gemv((m, k), scal, (af, (a_off, a_rs, a_cs)), (bf, (b_off, b_rs)), (cf, (c_off, c_rs)),
             epilogue, (epi & EPI_BIAS_ROW) != 0, acc)
    else:
        gemv((n, k), scal, (bf, (b_off, b_cs, b_rs)), (af, (a_off, a_cs)), (cf, (c_off, 1)),
             epilogue, (epi & EPI_BIAS_COL) != 0, acc)


@jit
def matvec(a, x, y):
    """``y = a @ x`` for a C-contiguous ``m x k`` matrix and contiguous vectors: matmul's
    shortest matrix-vector call.  ``y`` is also :func:`gemv`'s scratch (each value is
    written once its sum is complete) and its unread bias; ``ZERO`` for the epilogue
    flags and ``ZERO != 0`` for ``bias_row``, not literals, share gemv's compiled code
    with :func:`gemv_product`."""
    m, k = a.shape
    gemv((m, k), (DTYPE(1), DTYPE(0)), (a.reshape(-1), (ZERO, k, UNIT)), (x, (ZERO, UNIT)),
         (y, (ZERO, UNIT)), (y, ZERO), ZERO != 0, y)


@jit
def vecmat(x, a, y):
    """``y = x @ a`` for a C-contiguous ``k x n`` matrix and contiguous vectors, on the
    matrix's transposed view (as :func:`matvec`)."""
    k, n = a.shape
    gemv((n, k), (DTYPE(1), DTYPE(0)), (a.reshape(-1), (ZERO, UNIT, n)), (x, (ZERO, UNIT)),
         (y, (ZERO, UNIT)), (y, ZERO), ZERO != 0, y)
