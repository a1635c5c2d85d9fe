"""Template for the taps drivers (all taps per tile, B read in place), bound to one micro-kernel.

Written once per GEMM kernel (MR, NR, ISA) by
:func:`tilegemm.conv.engine.family_module`, which states what every template shares
(the configuration block, task loops over a shared counter).  Importable as is
(float32 6x64).
"""
import numba
import numpy as np

from tilegemm.conv import engine
from tilegemm.ground.contracts import JIT, imin, inner_jit, jit
from tilegemm.kernels.microkernel import Flavour
from tilegemm.kernels.registry import get_kernel, microkernel
from tilegemm.kernels.sync import next_task

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

_KERNEL = get_kernel(DTYPE, MR, NR, ISA)
macro_kernel = _KERNEL.module.macro_kernel
LANES = _KERNEL.lanes
_SHARED = engine.template_module("shared", DTYPE, isa=ISA)
phase_split = _SHARED.phase_split
ZERO, FALSE = _SHARED.ZERO, _SHARED.FALSE


# --- im2col without patches, NCHW: B read in place from the image --------------------
#
# With the image zero padded and split into its sy*sx stride phases
# (``xq[c, a, b, r, s] = xpad[c, r*sy + a, s*sx + b]``, each phase Hq x Wq), the
# patch-matrix row of channel c and kernel tap (i, j) over the output grid
# ``q = oh*Wq + ow`` is one contiguous run of ``xq``: it starts at
# ``c*chan + phase(i, j) + (i*dy // sy)*Wq + (j*dx // sx)``.  For a fixed tap the
# rows of successive channels are ``chan`` apart, a constant stride, so the strided
# micro-kernel reads B straight from ``xq`` and one GEMM per tap accumulates into
# the output tile: the 9x (kh*kw) blow-up of packing patches never happens; the
# copy is about one image.  The grid is Wq wide, so ``Wq - Wo`` columns per output
# row are computed and dropped, and C goes through a buffer.
#
# Stride 1 with Wo == W needs no copy at all: the grid is the image plane and the
# output plane (``q = oh*W + ow``), tap (i, j) of a grid position reads
# ``(i*dy - py)*W + j*dx - px`` elements away in the image itself, and tiles store
# straight into the output.  Where that would wrap round to the neighbouring row
# (left and right edges), leave the image plane (top and bottom rows) or pass the
# last grid position, the micro-kernel's masked loads read zero instead, without
# touching the memory; taps whose reads all stay in the image may instead read
# unmasked and have their sum masked once (``panel_masks`` in ``conv/im2col.py``).
#
# Other strides whose phase planes are exactly as wide as the output
# (``ceil(W/sx) == Wo``) get the same grid from an unpadded phase copy: tap (i, j)
# reads plane ((i*dy - py) mod sy, (j*dx - px) mod sx), rows and columns away by the
# floor quotients (negative above and left), through the same masks.

ukernel_taps = microkernel(DTYPE, ISA, MR, NR, Flavour.TAPS)
#: One vector wide, for a last panel of at most LANES columns (ResNet-18 conv5_x: 49
#: columns an image, 3 panels of 16 and 1 of 8 instead of 4 of 16).
ukernel_taps_narrow = microkernel(DTYPE, ISA, MR, LANES, Flavour.TAPS)
#: The last row panel of C when the output channels are not a multiple of MR, written
#: straight to the output by kernels of 4 and 2 rows over the first rows of MR-row
#: packed panels: every power-of-two channel count from 8 on leaves 2 or 4 rows of a
#: 6-row tile (ResNet-18 conv2_x: 64 = 10*6 + 4).  Other counts take a whole tile
#: through the C buffer.
ukernel_taps_4 = (microkernel(DTYPE, ISA, 4, NR, Flavour.TAPS, a_step=MR) if MR > 4
                  else ukernel_taps)
ukernel_taps_2 = (microkernel(DTYPE, ISA, 2, NR, Flavour.TAPS, a_step=MR) if MR > 2
                  else ukernel_taps)


@numba.njit(inline='always', **JIT)
def short_rows(rows):
    """Rows of the last row panel that a short kernel writes straight to C, else 0."""
    return rows if (rows == 4 and MR > 4) or (rows == 2 and MR > 2) else 0



@inner_jit
def taps_block(b, grid, ntaps, blocks, a, rows, columns, c, tail, epilogue):
    """Rows ``m0:m1`` x grid columns ``j0:j0+cols`` of the output, into C.

    The arguments, grouped: ``b`` ``(xq, b_base, chan)`` (B in place), ``grid``
    ``(taps, masks, sched)``, ``blocks`` ``(Cg, KC, MC)``, ``a`` ``(apack, a_off,
    Mp)`` (packed A), ``rows`` ``(m0, m1, rows_full, short)``, ``columns`` ``(j0,
    cols)``, ``c`` ``(c, c_off, ldc)``, ``tail`` ``(tail, tail_ld)``, ``epilogue``
    ``(bias, b_off, epi)``.

    Sums, over KC blocks of channels and over taps, packed A (block pc at
    ``a_off + pc*Mp*ntaps``, each row panel's taps one after another) times B read in place
    at ``xq[b_base + pc*chan + taps[t] + j0:]`` (rows ``chan`` apart).  Each tile
    sums every tap of a KC block in registers (:func:`ukernel_taps`), so C is
    updated once per KC block, not once per tap.  The panel starting at grid column
    ``q`` orders and masks its taps by the schedule ``sched[q // NR]`` (see
    ``make_microkernel``).  The usual blocking: an MC x KC block of A stays in L2
    across the NR-wide column panels, each panel's image rows stay in L1 across the
    block's row panels.

    Tiles of rows below ``rows_full`` and whole NR columns go to C (row ``m0 + i``,
    column ``j0 + j`` at ``c[c_off + i*ldc + j]``), and so do the first ``short``
    rows (:func:`short_rows`) of the row panel at ``rows_full`` in whole NR columns;
    the others (a partial row panel, a partial last column panel) whole into
    ``tail`` at ``i*tail_ld + j``, in the same pass over A and B.  A last panel of
    at most LANES columns runs the one-vector kernel.  ``j0``, ``m0``, ``m1``,
    ``rows_full`` and ``MC`` are multiples of NR or MR; beta 0 on the first KC block,
    ``epi`` on the last.
    """
    xq, b_base, chan = b
    taps, masks, sched = grid
    Cg, KC, MC = blocks
    apack, a_off, Mp = a
    m0, m1, rows_full, short = rows
    j0, cols = columns
    c, c_off, ldc = c
    tail, tail_ld = tail
    bias, b_off, epi = epilogue
    full = cols // NR * NR
    for pc in range(0, Cg, KC):
        kc = imin(KC, Cg - pc)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        e = epi if pc + KC >= Cg else 0
        for ic in range(m0, m1, MC):
            ic_end = imin(ic + MC, m1)
            for jr in range(0, cols, NR):
                tm = sched[(j0 + jr) // NR]
                narrow = jr == full and cols - full <= LANES < NR
                b_at = b_base + pc * chan + j0 + jr
                for ir in range(ic, ic_end, MR):
                    a_at = a_off + (pc * Mp + ir * kc) * ntaps
                    if ir < rows_full and jr < full:
                        dst, c_at, ld = c, c_off + (ir - m0) * ldc + jr, ldc
                    elif ir == rows_full and short and jr < full:
                        c_at = c_off + (ir - m0) * ldc + jr
                        if short == 4:
                            ukernel_taps_4(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                           masks, 0, tm, c, c_at, ldc, DTYPE(1), beta, bias,
                                           b_off + ir, e)
                        else:
                            ukernel_taps_2(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                           masks, 0, tm, c, c_at, ldc, DTYPE(1), beta, bias,
                                           b_off + ir, e)
                        continue
                    else:
                        dst, c_at, ld = tail, (ir - m0) * tail_ld + jr, tail_ld
                    if narrow:
                        ukernel_taps_narrow(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                            masks, 0, tm, dst, c_at, ld, DTYPE(1), beta, bias,
                                            b_off + ir, e)
                    else:
                        ukernel_taps(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                     masks, 0, tm, dst, c_at, ld, DTYPE(1), beta, bias, b_off + ir,
                                     e)


@inner_jit
def _copy_rows(cbuf, ldb, out, dst, ldo, rows, cols):
    """``out[dst + k*ldo : +cols] = cbuf[k*ldb : +cols]`` for ``k < rows``.

    Element by element: assigning one slice to the other makes Numba check their
    shapes, and the exception it would raise, both shapes formatted into its
    message, compiles a large body of string formatting into every caller.
    """
    for k in range(rows):
        src = cbuf[k * ldb:k * ldb + cols]
        dst_row = out[dst + k * ldo:dst + k * ldo + cols]
        for j in range(cols):
            dst_row[j] = src[j]


@numba.njit(inline='always', **JIT)
def _stage_image(r, copy, x, x_at, xq, padded):
    """Where B is read for one image of a taps task (``r`` the plan record's row): ``(src, off)``.

    FLAT (``xq`` None): ``x`` itself.  PHASED (``padded`` None): unpadded stride-phase
    planes (the taps reach across their edges through masks) copied into ``xq``
    after ``slack`` zeros.  PADDED: zero-padded phase planes in ``xq``.  ``copy``
    False: ``xq`` already holds this image.  The layout is told by None arguments so
    that Numba compiles only its branch (the copy alone costs 0.5 s of a first call).
    """
    if xq is None:
        return x, x_at
    if padded is None:
        if copy:
            phase_split(x, (x_at, r.xs_c, r.xs_h), (r.Cg, r.H, r.W), (r.sy, r.sx, ZERO, ZERO),
                        (r.Hq, r.Wq, r.chan), xq[r.slack:], FALSE)
        return xq, r.slack
    if copy:
        phase_split(x, (x_at, r.xs_c, r.xs_h), (r.Cg, r.H, r.W), (r.sy, r.sx, r.py, r.px),
                    (r.Hq, r.Wq, r.chan), xq, FALSE)
    return xq, ZERO


@inner_jit
def _copy_grid_columns(cbuf, ldb, j0, cols, Wq, Wo, out, co, sk, M):
    """Copy grid columns ``j0:j0+cols`` of ``cbuf`` to ``out``: one output-row run at a
    time, the grid's columns past ``Wo`` (padding) skipped."""
    q = j0
    while q < j0 + cols:
        oh = q // Wq
        ow = q % Wq
        run = imin(Wq - ow, j0 + cols - q)
        if ow < Wo:
            _copy_rows(cbuf[q - j0:], ldb, out, co + oh * Wo + ow, sk, M, imin(run, Wo - ow))
        q += run


@numba.njit(inline='always', **JIT)
def pack_tails(x, x_off, xs0, xs1, N, reads, ntaps, tail, pc, kc, bpack):
    """B of :func:`taps_tails` for channels ``pc:pc+kc``, as NR-wide packed panels.

    Column ``j = n*tail + i`` is tail column ``i`` of image ``n``; row ``t*kc + k``
    is what tap ``t`` reads there in channel ``pc + k``: the pixel ``reads[t, i]``
    elements into the channel, zero where that is -1 (outside the image).  Columns
    past ``N*tail`` are zero.
    """
    ncols = N * tail
    rows = ntaps * kc
    for jp in range(0, ncols, NR):
        panel = bpack[jp * rows:(jp + NR) * rows]
        for j in range(NR):
            if jp + j >= ncols:
                for r in range(rows):
                    panel[r * NR + j] = 0
                continue
            n, i = (jp + j) // tail, (jp + j) % tail
            base = x_off + n * xs0 + pc * xs1
            for t in range(ntaps):
                src = base + reads[t, i]
                for k in range(kc):
                    panel[(t * kc + k) * NR + j] = x[src + k * xs1] if reads[t, i] >= 0 else 0


@numba.njit(inline='always', **JIT)
def taps_tails(task, g, plan, reads, x, apack, epilogue, out, bufs):
    """Tails task ``task`` of group ``g``: rows ``m0:m1`` (MR multiples, a share of
    ``tail_parts``) of grid columns ``q_end:`` (the part of a panel after the last
    whole one) of ``tail_imgs`` images, as one GEMM with columns from all of them.

    Each image's own tail panel would run mostly idle lanes.  A is the taps
    kernel's (each row panel's taps are one packed panel of ``ntaps*kc``), B is
    packed from the images by :func:`pack_tails` (``reads``: where the taps read in
    a channel), C goes through the thread's ``cbuf`` into each image.  Arguments as
    for :func:`taps_tasks`.
    """
    r = plan[0]
    bias, bias_group, epi = epilogue
    cbuf, bpack = bufs
    Cg, M, Mp, ntaps, KC = r.Cg, r.M, r.Mp, r.ntaps, r.KC
    N = (r.ntasks // r.groups - r.tail_tasks) // r.parts
    n0 = task // r.tail_parts * r.tail_imgs
    per = (Mp // MR + r.tail_parts - 1) // r.tail_parts * MR
    m0 = task % r.tail_parts * per
    if m0 >= Mp:
        return
    m1 = imin(Mp, m0 + per)
    images = imin(r.tail_imgs, N - n0)
    q0, tail = r.q_end, r.Ho * r.Wq - r.q_end
    x_off = g * Cg * r.xs_c + n0 * r.xs_n
    o_off = g * M * r.os_k + n0 * r.os_n
    a_off, b_off = g * r.a_group, g * bias_group
    ldc = (images * tail + NR - 1) // NR * NR
    for pc in range(0, Cg, KC):
        kc = imin(KC, Cg - pc)
        pack_tails(x, x_off, r.xs_n, r.xs_c, images, reads, ntaps, tail, pc, kc, bpack)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        e = epi if pc + KC >= Cg else 0
        macro_kernel((m1 - m0, ldc, ntaps * kc), apack, a_off + (pc * Mp + m0 * kc) * ntaps,
                     bpack, ZERO, cbuf, m0 * ldc, ldc, (DTYPE(1), beta), (bias, e),
                     (b_off + m0, ZERO))
    for n in range(images):
        _copy_rows(cbuf[m0 * ldc + n * tail:], ldc, out, o_off + n * r.os_n + m0 * r.os_k + q0,
                   r.os_k, imin(m1, M) - m0, tail)


@jit
def taps_tasks(counter, plan, grid, reads, x, apack, epilogue, out, bufs, xq, padded):
    """Tasks taken from ``counter`` until ``ntasks`` are out, ``ntasks // groups`` per group.

    ``plan`` is :func:`tilegemm.conv.taps.taps_plan`'s record (its names below),
    ``grid`` ``(taps, masks, sched)`` (see :func:`taps_block`), ``epilogue`` ``(bias,
    bias_group, epi)``, ``bufs`` the thread's ``(cbuf, bpack)``: ``cbuf`` an ``Mp x
    NCB`` block of C; ``xq`` its image copy (None: FLAT), ``padded`` None but in the
    PADDED layout.  Group ``g`` reads channels ``g*Cg:`` of ``x``, writes its ``M``
    output channels from ``g*M``; its packed weights start at ``apack[g*a_group]``.

    A group's first ``tail_tasks`` run :func:`taps_tails` over the grid columns from
    ``q_end`` on; ``reads`` is None for a layer without tails (Numba then prunes
    them: a 7x7 stem's padded layout never has any).  The others are image * parts +
    part: that part's share of the NCB column blocks of the image's first ``q_end``
    grid columns, the image staged by :func:`_stage_image` unless the thread's
    previous task had it.  FLAT and PHASED grids are the output plane: with
    ``direct`` whole tiles go straight into ``out``, the partial row panel and last
    column panel through ``cbuf``; without, all of C goes through ``cbuf``.  PADDED
    grids go through ``cbuf``, their valid columns copied out.  The loop holds the
    task's body: an inlined one would cost the compile a copy of its IR.
    """
    r = plan[0]
    bias, bias_group, epi = epilogue
    cbuf, _ = bufs
    Cg, M, Mp, ntaps, KC, MC, NCB = r.Cg, r.M, r.Mp, r.ntaps, r.KC, r.MC, r.NCB
    per_group, parts, chan, sk = r.ntasks // r.groups, r.parts, r.chan, r.os_k
    N = (per_group - r.tail_tasks) // parts
    m_full = M // MR * MR
    blocks = (r.q_end + NCB - 1) // NCB
    per_part = (blocks + parts - 1) // parts
    last = -1
    while True:
        task = next_task(counter)
        if task >= r.ntasks:
            break
        g = task // per_group
        task -= g * per_group
        if task < r.tail_tasks:
            if reads is not None:
                taps_tails(task, g, plan, reads, x, apack, epilogue, out, bufs)
            continue
        n, part = (task - r.tail_tasks) // parts, (task - r.tail_tasks) % parts
        a_off, b_off = g * r.a_group, g * bias_group
        src, src_off = _stage_image(r, g * N + n != last, x, g * Cg * r.xs_c + n * r.xs_n, xq,
                                     padded)
        last = g * N + n                # the copy in xq is of this image's group
        co = g * M * sk + n * r.os_n
        for blk in range(part * per_part, imin(blocks, (part + 1) * per_part)):
            j0 = blk * NCB
            cols = imin(NCB, r.q_end - j0)
            if padded is not None:
                panels = (cols + NR - 1) // NR * NR
                taps_block((xq, ZERO, chan), grid, ntaps, (Cg, KC, MC), (apack, a_off, Mp),
                           (ZERO, Mp, ZERO, ZERO), (j0, panels), (cbuf, ZERO, NCB), (cbuf, NCB),
                           (bias, b_off, epi))
                _copy_grid_columns(cbuf, NCB, j0, cols, r.Wq, r.Wo, out, co, sk, M)
            elif not r.direct:
                # A tile's rows would share L1 sets in out (channels a whole number of
                # pages apart): C goes through cbuf, copied out once.
                taps_block((src, src_off, chan), grid, ntaps, (Cg, KC, MC), (apack, a_off, Mp),
                           (ZERO, Mp, ZERO, ZERO), (j0, cols), (cbuf, ZERO, NCB), (cbuf, NCB),
                           (bias, b_off, epi))
                _copy_rows(cbuf, NCB, out, co + j0, sk, M, cols)
            else:
                short = short_rows(M - m_full)
                taps_block((src, src_off, chan), grid, ntaps, (Cg, KC, MC), (apack, a_off, Mp),
                           (ZERO, Mp, m_full, short), (j0, cols), (out, co + j0, sk),
                           (cbuf, NCB), (bias, b_off, epi))
                full = cols // NR * NR
                if full < cols:
                    _copy_rows(cbuf[full:], NCB, out, co + j0 + full, sk, m_full, cols - full)
                if m_full < M:
                    done = full if short else 0     # whole columns the short kernel wrote
                    _copy_rows(cbuf[m_full * NCB + done:], NCB, out,
                               co + m_full * sk + j0 + done, sk, M - m_full, cols - done)
