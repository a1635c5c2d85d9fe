"""Template for the int8 GEMM bound to one int8 micro-kernel: packers, corrections, five loops.

``tilegemm.kernels.qgemm`` writes one module per (kind, bits) from this file with
the configuration block filled in, as ``kernels/registry.py`` does for the float
kernels: MR, NR and GROUP are compile-time constants, and Numba caches each
module's machine code in its own file.

``C = (A - za) @ (B - zb)``, int32, exact.  The loops are the float GEMM's (jc,
pc, ic, jr, ir); the panels hold 32-bit words of ``GROUP`` consecutive k values
(``kernels/int8.py``), zero past k's end and past the last row or column.  Each
operand is packed as ``value + add``: for ``madd`` and ``generic`` the adds are
minus the zero points, and the tile's int16 products need nothing more; for the
byte kinds (``vnni``, ``maddubs``) they make A unsigned and B signed bytes, and
:func:`corrections` gives the per-row and per-column terms that turn ``A' @ B'``
back into the product.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT, jit
from tilegemm.kernels.int8 import A_BLOCKS as _A_BLOCKS
from tilegemm.kernels.int8 import KSTEP as _KSTEPS
from tilegemm.kernels.int8 import make_int8_tile, make_tile_begin
from tilegemm.kernels.int8_taps import (TILE_PLACES, add_residual, amx_first, amx_places,
                                        amx_rows, amx_rows_past, amx_tile_places, in_place_end,
                                        tap_runs)
from tilegemm.kernels.requant import finish_planes, finish_rows
from tilegemm.kernels.sync import publish
from tilegemm.kernels.widen import widen_rows

# --- configuration ---
KIND = "vnni"
BITS = 512
MR = 6
NR = 64
GROUP = 4
# --- end configuration ---

#: Groups per step of the tile's k loop: panels hold k padded to whole steps, and A's
#: panel keeps a row's words of one step together (word (i, g) at :func:`a_word`).
KSTEP = _KSTEPS.get(KIND, 1)

#: MC blocks of A packed at once (:func:`_qgemm_slabs`, KSTEP > 1), else 1.
A_BLOCKS = _A_BLOCKS.get(KIND, 1)

tile = make_int8_tile(KIND, BITS, MR, NR)
tile_begin, tile_end = make_tile_begin(KIND)


@numba.njit(inline="always", **JIT)
def groups(kc):
    """Groups of GROUP k values in a panel of ``kc`` values: whole steps of KSTEP."""
    return (kc + GROUP * KSTEP - 1) // (GROUP * KSTEP) * KSTEP


@numba.njit(inline="always", **JIT)
def a_word(i, g):
    """The word of row ``i``, group ``g`` in a panel of A (MR rows): group-major
    (``g * MR + i``), or with KSTEP > 1 step-major, each row's KSTEP words together."""
    return (g // KSTEP) * MR * KSTEP + i * KSTEP + g % KSTEP


@jit
def pack_a(a, i0, mc, p0, kc, a_add, out):
    """Rows ``i0:i0+mc`` and columns ``p0:p0+kc`` of A, plus ``a_add``, into panels of
    MR rows: per group of GROUP k values, MR words, row i's group g at
    :func:`a_word`."""
    kg = groups(kc)
    whole = kc // GROUP
    for ir in range(0, mc, MR):
        base = (ir // MR) * kg * MR * GROUP
        rows = min(MR, mc - ir)
        for g in range(kg):
            at = base + a_word(0, g) * GROUP
            if g < whole and rows == MR:   # the common case, with no test per value
                for i in range(MR):
                    for t in range(GROUP):
                        out[at + i * KSTEP * GROUP + t] = a[i0 + ir + i, p0 + g * GROUP + t] + a_add
            else:
                _edge_group(a, (i0 + ir, KSTEP), p0, MR, rows, kc, g, a_add, out, at)


@jit
def pack_a_words(a_words, i0, mc, g0, kg, flip, out):
    """:func:`pack_a` for the byte kinds when A's rows are whole 32-bit words (k a multiple of 4,
    rows contiguous): ``a_words`` is A viewed as words, and a word of A is a word of the
    panel, ``^ flip`` (0x80808080 adds 128 to every byte of an int8 A).  Groups
    ``g0:g0+kg``; rows past ``mc`` and groups past A's end are zero.  Three times
    faster than byte by byte."""
    real = max(0, min(kg, a_words.shape[1] - g0))
    whole = real // KSTEP * KSTEP      # whole steps of A's words: runs of KSTEP words
    for ir in range(0, mc, MR):
        base = (ir // MR) * kg * MR
        for i in range(MR):
            o = out[base + a_word(i, 0):]
            if ir + i < mc:
                row = a_words[i0 + ir + i, g0:g0 + real]
                for s in range(0, whole, KSTEP):
                    run = o[a_word(0, s):a_word(0, s) + KSTEP]
                    for t in range(KSTEP):
                        run[t] = row[s + t] ^ flip
                for g in range(whole, kg):
                    o[a_word(0, g)] = row[g] ^ flip if g < real else 0
            else:
                for g in range(kg):
                    o[a_word(0, g)] = 0


@jit
def pack_b(b, p0, kc, j0, nc, b_add, out):
    """Rows ``p0:p0+kc`` and columns ``j0:j0+nc`` of B, plus ``b_add``, into panels of
    NR columns: per group of GROUP k values, NR words, column j's values in word j."""
    kg = groups(kc)
    whole = kc // GROUP
    full = nc // NR                    # panels of NR columns
    stride = kg * NR * GROUP           # values from one panel to the next
    for g in range(whole):             # the common case: whole groups of whole panels
        _interleave_rows(b, p0 + g * GROUP, j0, full, b_add, out[g * NR * GROUP:], stride)
    for jr in range(0, nc, NR):
        base = (jr // NR) * stride
        width = min(NR, nc - jr)
        for g in range(whole if width == NR else 0, kg):
            # B's columns are the lines: its transpose, as A's rows
            _edge_group(b.T, (j0 + jr, 1), p0, NR, width, kc, g, b_add, out,
                        base + g * NR * GROUP)


@jit
def pack_b_blocks(b, KC, NC, b_add, out):
    """Every KC x NC block of B, plus ``b_add``, packed by :func:`pack_b` one after the
    other in the order :func:`qgemm` reads them (jc, then pc): B's panels made once,
    for a B that many products share (a layer's weights)."""
    k, n = b.shape
    at = 0
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, k, KC):
            kc = min(KC, k - pc)
            pack_b(b, pc, kc, jc, nc, b_add, out[at * GROUP:])
            at += (nc + NR - 1) // NR * NR * groups(kc)


@jit
def _edge_group(m, first, k0, lines, valid, kc, g, add, out, at):
    """Group ``g`` of a panel's ``lines`` words from ``out[at:]``, ``first = (r0,
    apart)``: line ``i``'s word ``apart`` words after line i-1's, from row ``r0 + i``
    of ``m`` (columns ``k0 + g*GROUP`` on), plus ``add``; zero past the ``valid``
    lines and past column ``kc``: the edge of a panel of A or of B."""
    r0, apart = first
    for i in range(lines):
        for t in range(GROUP):
            p = g * GROUP + t
            inside = i < valid and p < kc
            out[at + i * apart * GROUP + t] = m[r0 + i, k0 + p] + add if inside else 0


@jit
def _interleave_rows(b, p, j, panels, add, out, stride):
    """One group of rows of ``panels`` whole panels: ``out[q * stride + i * GROUP + t] =
    b[p + t, j + q * NR + i] + add``.

    The GROUP rows are sliced once for every panel (slices per panel cost more than
    the panel's values) and each panel's words are built from them in registers
    (shifts and ors of the widened values, a loop LLVM vectorises); interleaving
    values by stores, or a row at a time, ran 2-7x slower."""
    width = panels * NR
    words = out.view(np.uint32)
    r0, r1 = b[p, j:j + width], b[p + 1, j:j + width]
    if GROUP == 4:
        r2, r3 = b[p + 2, j:j + width], b[p + 3, j:j + width]
        for q in range(panels):
            o = words[q * stride // GROUP:q * stride // GROUP + NR]
            s0, s1, s2, s3 = r0[q * NR:], r1[q * NR:], r2[q * NR:], r3[q * NR:]
            for i in range(NR):
                o[i] = (np.uint32(np.uint8(s0[i] + add)) | (np.uint32(np.uint8(s1[i] + add)) << 8)
                        | (np.uint32(np.uint8(s2[i] + add)) << 16)
                        | (np.uint32(np.uint8(s3[i] + add)) << 24))
    else:
        for q in range(panels):
            o = words[q * stride // GROUP:q * stride // GROUP + NR]
            s0, s1 = r0[q * NR:], r1[q * NR:]
            for i in range(NR):
                o[i] = (np.uint32(np.uint16(s0[i] + add))
                        | (np.uint32(np.uint16(s1[i] + add)) << 16))


@jit
def corrections(a, b, adds, alpha, beta, rc, cc):
    """``rc[i] = beta * sum_p A'[i, p] - k * alpha * beta`` and ``cc[j] = -alpha *
    sum_p B'[p, j]`` (``A' = A + adds[0]``, ``B' = B + adds[1]``), wrapped to int32:
    with them ``(A - za) @ (B - zb) = A' @ B' + rc[i] + cc[j]`` for ``alpha = za +
    adds[0]`` and ``beta = -(zb + adds[1])``.  Each sum is skipped when its factor is 0."""
    m, k = a.shape
    n = b.shape[1]
    a_add, b_add = adds
    for i in range(m):
        s = 0
        if beta != 0:
            for p in range(k):
                s += a[i, p] + a_add
        rc[i] = beta * s - k * alpha * beta
    cc[:n] = 0
    if alpha != 0:
        column_sums(b, b_add, cc)
        for j in range(n):
            cc[j] = -alpha * cc[j]


@jit
def column_sums(b, add, out):
    """``out[j] = sum_p (b[p, j] + add)`` in ``out``'s int64 (or int32, wrapped), the
    bytes summed in int16 lanes 128 rows at a time (255 x 128 < 2**15): 512 x 512
    bytes in 7.6 us, 20 in int32 lanes here (numpy's ``b.sum(axis=0,
    dtype=np.int64)`` 85)."""
    k, n = b.shape
    out[:n] = k * add
    part = np.zeros(n, np.int16)
    for p0 in range(0, k, 128):
        for p in range(p0, min(k, p0 + 128)):
            row = b[p]
            for j in range(n):
                part[j] += row[j]
        for j in range(n):
            out[j] += part[j]
            part[j] = 0


@jit
def qgemm(a, b, c, c_at, adds, blocks, packs, rc, cc, a_words, b_panels, gate):
    """``C = A' @ B' + rc[i] + cc[j]`` over the five loops (see the module docstring).

    ``a`` (m x k) and ``b`` (k x n): int8 or uint8, any strides.  ``c``: flat int32,
    ``C[i, j]`` at ``c_at[0] + i * c_at[1] + j``.  ``adds``: what the packers add to
    A and B.  ``blocks``: ``(KC, MC, NC)``, KC a multiple of GROUP.  ``packs``:
    ``(apack, apack_values, bpack, bpack_values)``, each buffer as int32 words and as
    its packed values.  ``rc``/``cc``: m and n int32 corrections (:func:`corrections`).
    ``a_words``: ``(words, signed, lda)``: A as 32-bit words (2-D) for
    :func:`pack_a_words`, the same as int32 and its row stride in words, read in
    place by the tile (from the data pointer, ``lda`` words a row) when A needs no
    flip (a byte kind, uint8 A); or an empty ``words``: A is packed a value at a
    time.  ``b_panels``: B's blocks packed
    by :func:`pack_b_blocks` with these KC and NC (int32 words), or empty: B is
    packed here, block by block.  ``gate``: as for :func:`qconv_taps_blocks`.
    """
    publish(gate, 0, 1)
    if KSTEP > 1:
        return _qgemm_slabs(a, b, c, c_at, adds, blocks, packs, rc, cc, a_words, b_panels)
    m, k = a.shape
    n = b.shape[1]
    c_off, ldc = c_at
    KC, MC, NC = blocks
    apack, apack_values, bpack, bpack_values = packs
    words, a_flat, lda = a_words
    # Only the byte kinds pass words, and there adds[0] is 128 exactly when A is int8: its
    # words are flipped into a panel; a uint8 A's are read where they lie.
    flip = np.uint32(0x80808080) if adds[0] == 128 else np.uint32(0)
    in_place = words.size > 0 and adds[0] == 0 and KSTEP == 1   # AMX loads whole steps
    at = 0                                    # the next block in b_panels, in words
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, max(k, 1), KC):    # k == 0 still writes C once (the corrections)
            kc = min(KC, k - pc)
            kg = groups(kc)
            if b_panels.size > 0:
                b_src = b_panels[at:]
                at += (nc + NR - 1) // NR * NR * kg
            else:
                pack_b(b, pc, kc, jc, nc, adds[1], bpack_values)
                b_src = bpack
            first = 1 if pc == 0 else 0
            for ic in range(0, m, MC):
                mc = min(MC, m - ic)
                c_block = (c_off + ic * ldc + jc, ldc, first, ic, jc)
                if in_place:     # A's words are the tile's: no packing
                    _macro(kg, (a_flat, ic * lda + pc // GROUP, lda, 1), b_src, c, c_block,
                           rc, cc, mc, nc)
                else:
                    if words.size > 0:
                        pack_a_words(words, ic, mc, pc // GROUP, kg, flip, apack)
                    else:
                        pack_a(a, ic, mc, pc, kc, adds[0], apack_values)
                    _macro(kg, (apack, 0, KSTEP, MR * KSTEP), b_src, c, c_block, rc, cc, mc,
                           nc)


@jit
def _qgemm_slabs(a, b, c, c_at, adds, blocks, packs, rc, cc, a_words, b_panels):
    """:func:`qgemm` for KSTEP > 1 (AMX), whose tiles outrun packing: per KC block of k,
    a slab of A_BLOCKS x MC rows is packed once and read by every NC block of B
    (pc, then slabs, then jc, ic, jr, ir).  With the BLIS order each NC block packed
    A again: at NC = 512 (a B block AMX keeps in L2) a third of a 2048^3 product.
    Arguments as :func:`qgemm`'s; A is never read in place (a tile loads whole steps)."""
    m, k = a.shape
    n = b.shape[1]
    c_off, ldc = c_at
    KC, MC, NC = blocks
    apack, apack_values, bpack, bpack_values = packs
    words = a_words[0]
    flip = np.uint32(0x80808080) if adds[0] == 128 else np.uint32(0)
    all_groups = 0                            # of every k block: b_panels' stride per NC
    for pc in range(0, k, KC):
        all_groups += groups(min(KC, k - pc))
    for pc in range(0, max(k, 1), KC):        # k == 0 still writes C once (the corrections)
        kc = min(KC, k - pc)
        kg = groups(kc)
        first = 1 if pc == 0 else 0
        for i0 in range(0, m, A_BLOCKS * MC):
            ms = min(A_BLOCKS * MC, m - i0)
            if words.size > 0:
                pack_a_words(words, i0, ms, pc // GROUP, kg, flip, apack)
            else:
                pack_a(a, i0, ms, pc, kc, adds[0], apack_values)
            for jc in range(0, n, NC):
                nc = min(NC, n - jc)
                if b_panels.size > 0:     # laid out jc, then pc: blocks before are whole
                    b_src = b_panels[(jc // NC) * NC * all_groups
                                     + (nc + NR - 1) // NR * NR * (pc // KC) * groups(KC):]
                else:
                    pack_b(b, pc, kc, jc, nc, adds[1], bpack_values)
                    b_src = bpack
                for ic in range(0, ms, MC):
                    c_block = (c_off + (i0 + ic) * ldc + jc, ldc, first, i0 + ic, jc)
                    _macro(kg, (apack, (ic // MR) * kg * MR, KSTEP, MR * KSTEP), b_src, c,
                           c_block, rc, cc, min(MC, ms - ic), nc)


@jit
def _macro(kg, a_src, b_src, c, c_block, rc, cc, mc, nc):
    """The tiles of one mc x nc block of C (the jr and ir loops) over ``kg`` groups of
    k: A from ``a_src = (a, at, rs, gs)`` (its packed panels, ``rs = 1, gs = MR``, or
    its words in place, ``rs`` = the row stride, ``gs = 1``), B's panels from
    ``b_src``; ``c_block = (offset, ldc, first, ic, jc)``: the block's first value in
    ``c``, as the tile takes them, and its first row and column for the corrections."""
    a, a_at, a_rs, a_gs = a_src
    c_at, ldc, first, ic, jc = c_block
    # AMX: the tile configuration is caller-saved state; loaded here, next to its
    # tiles, no call between them can have changed it (a few cycles per block)
    tile_begin()
    for jr in range(0, nc, NR):
        for ir in range(0, mc, MR):
            tile(kg, a, a_at + (ir * a_rs if a_gs == 1 else (ir // MR) * kg * MR), a_rs, a_gs,
                 b_src, (jr // NR) * kg * NR, c, c_at + ir * ldc + jr, ldc, first, rc, ic + ir,
                 cc, jc + jr, min(MR, mc - ir), min(NR, nc - jr))
    tile_end()


tile_taps = make_int8_tile(KIND, BITS, MR, NR, taps=True)
tile_codes = make_int8_tile(KIND, BITS, MR, NR, taps=True, codes=True)


@jit
def qconv_taps(xw, geom, channels, b_panels, blocks, c, part, zeros, cc, seg, a_at, codes):
    """``C = acc + cc[j]`` of a convolution's output pixels read from the widened image
    in place; or, where k is one block and ``codes`` names an output, their codes.

    ``xw``: :func:`widen_rows`'s rows as int32 words (GROUP channels each), its
    first row the padded image's row ``row0``.  ``geom = (Wp, Cw, Wo, kh, kw, sy, sx,
    dy, dx, row0)``: the padded width, words per pixel, output width, kernel, stride,
    dilation.  ``channels = (c0w, cgw, n)``: the group's first word and words per
    pixel, and its output channels.  ``b_panels``: the group's ``kh*kw*Cg x n``
    weights ((r, s, c) rows) packed by :func:`pack_b_blocks` with ``blocks = (KC, MC,
    NC)``.  ``part = (p0, p1, j0, j1)``: the output pixels ``p0:p1`` and channels
    ``j0:j1`` (``j0`` a multiple of NR) to compute.  ``c``: flat int32, ``n`` per
    pixel, from pixel ``p0``; only columns ``j0:j1`` are written.  ``zeros``: at least
    ``MR`` zero int32 (no row corrections: the weights' zero point is 0).  ``cc``: the
    ``n`` column corrections (zero for the pair kinds, whose A is ``x - zero``; minus
    the padding byte times each column's sum of B for the byte kinds).  ``seg``: room
    for ``2 * (kh*kw + 1)`` intp; ``a_at``: for ``p1 - p0`` intp, each pixel's first
    word in ``xw``.  ``codes = (o, o_at, ldo, mult, bias, lim)``: an int8 or uint8
    output, pixel ``p``'s channel ``j`` at ``o[o_at + (p - p0)*ldo + j]``, and the
    group's requantization as the codes tile takes it, or an empty ``o``.  Returns
    whether the codes were written (``o`` given and k in one block: the tiles write
    them from their registers, ``c`` untouched), else the sums were.
    """
    Wp, Cw, Wo, kh, kw, sy, sx, dy, dx, row0 = geom
    c0w, cgw, n = channels
    KC, MC, NC = blocks
    p0, p1, j0, j1 = part
    o, o_at, ldo, mult, bias, lim = codes
    if KSTEP > 1:
        return _qconv_taps_amx(xw, geom, channels, b_panels, blocks, c, part, zeros, cc, seg,
                               a_at, codes)
    for q in range(p0, p1):
        a_at[q - p0] = (((q // Wo) * sy - row0) * Wp + (q % Wo) * sx) * Cw
    k_groups = kh * kw * cgw
    direct = o.size > 0 and k_groups <= KC // GROUP
    at = 0                                    # the next block in b_panels, in words
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for g0 in range(0, k_groups, KC // GROUP):
            g1 = min(g0 + KC // GROUP, k_groups)
            b_src, at, segs = _k_block(b_panels, at, nc, (g0, g1),
                                       (cgw, (Wp, Cw, kw, dy, dx), c0w), seg)
            first = 1 if g0 == 0 else 0
            for ic in range(0, p1 - p0, MC):
                mc = min(MC, p1 - p0 - ic)
                for jr in range(max(j0 - jc, 0), min(j1 - jc, nc), NR):
                    cols = min(NR, j1 - jc - jr, nc - jr)
                    for ir in range(0, mc, MR):
                        b_at = (jr // NR) * (g1 - g0) * NR
                        if direct:
                            tile_codes(segs, seg, xw, a_at, ic + ir, b_src, b_at, o,
                                       o_at + (ic + ir) * ldo + jc + jr, ldo, cc, jc + jr,
                                       min(MR, mc - ir), cols, mult, bias, lim)
                        else:
                            tile_taps(segs, seg, xw, a_at, ic + ir, b_src, b_at, c,
                                      (ic + ir) * n + jc + jr, n, first, zeros, 0, cc, jc + jr,
                                      min(MR, mc - ir), cols)
    return direct


@jit
def _k_block(b_panels, at, nc, span, taps, seg):
    """Groups ``span = (g0, g1)`` of k of a block of ``nc`` columns: its panels (from
    word ``at`` of ``b_panels``), the word after them, and its runs of k in ``seg``
    (:func:`~tilegemm.kernels.int8_taps.tap_runs` with ``taps = (cgw, geom, c0w)``)."""
    g0, g1 = span
    cgw, geom, c0w = taps
    return (b_panels[at:], at + (nc + NR - 1) // NR * NR * (g1 - g0),
            tap_runs(g0, g1, cgw, geom, c0w, seg))


@jit
def _qconv_taps_amx(xw, geom, channels, b_panels, blocks, c, part, zeros, cc, seg, a_at, codes):
    """:func:`qconv_taps` on AMX tiles: the output pixels go in tiles of 32 of
    :func:`~tilegemm.kernels.int8_taps.amx_rows`'s rows (pixels the layer does not have
    are computed and dropped), each A tile 16 of them read from the widened image a
    constant stride apart; ``a_at`` holds every tile's places
    (:func:`~tilegemm.kernels.int8_taps.amx_tile_places`), at least
    :func:`~tilegemm.kernels.int8_taps.amx_places` intp.  Every run of k must be whole
    steps of 16 groups (a tap's channels a multiple of 64, or a kernel row's taps made
    up with zero taps: ``kernels.qgemm.amx_taps_shape``), and the widened
    rows must extend past the last output pixel's far enough for a whole tile
    (:func:`~tilegemm.kernels.int8_taps.amx_rows_past`)."""
    Wp, Cw, Wo, kh, kw, sy, sx, dy, dx, row0 = geom
    c0w, cgw, n = channels
    KC, MC, NC = blocks
    p0, p1, j0, j1 = part
    o, o_at, ldo, mult, bias, lim = codes
    Wv = amx_rows(Wp, Wo, sy, sx)
    v0 = amx_first(p0, (Wv, Wo, Wp), (sy, sx))
    v1 = ((p1 - 1) // Wo) * Wv + (p1 - 1) % Wo + 1
    last_row = ((p1 - 1) // Wo) * sy - row0 + (kh - 1) * dy + 1
    if (xw.size < (last_row + amx_rows_past(Wp, Wo, (kw, dx), (sy, sx))) * Wp * Cw
            or a_at.size < amx_places(p1 - p0, Wo, Wv) or zeros.size < MR or MC % MR):
        raise ValueError("qconv_taps: too little room for the amx tiles' rows or places")
    k_groups = kh * kw * cgw
    for g0 in range(0, k_groups, KC // GROUP):    # before the tiles are configured
        segs = tap_runs(g0, min(g0 + KC // GROUP, k_groups), cgw, (Wp, Cw, kw, dy, dx), c0w, seg)
        for r in range(segs):
            if seg[2 * r + 1] % KSTEP:
                raise ValueError("qconv_taps: an amx run of k is not whole steps")
    direct = o.size > 0 and k_groups <= KC // GROUP
    amx_tile_places((Wv, Wo, Wp, Cw, sy, sx, row0), (v0, v1, p0, p1), ldo if direct else n, a_at)
    tile_begin()
    at = 0                                    # the next block in b_panels, in words
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for g0 in range(0, k_groups, KC // GROUP):
            g1 = min(g0 + KC // GROUP, k_groups)
            b_src, at, segs = _k_block(b_panels, at, nc, (g0, g1),
                                       (cgw, (Wp, Cw, kw, dy, dx), c0w), seg)
            first = 1 if g0 == 0 else 0
            for ic in range(v0, v1, MC):
                for jr in range(max(j0 - jc, 0), min(j1 - jc, nc), NR):
                    cols = min(NR, j1 - jc - jr, nc - jr)
                    b_at = (jr // NR) * (g1 - g0) * NR
                    for vt in range(ic, min(ic + MC, v1), MR):
                        places = (vt - v0) // MR * TILE_PLACES
                        if direct:
                            tile_codes(segs, seg, xw, a_at, places, b_src, b_at, o,
                                       o_at + jc + jr, ldo, cc, jc + jr, MR, cols, mult, bias,
                                       lim)
                        else:
                            tile_taps(segs, seg, xw, a_at, places, b_src, b_at, c, jc + jr, n,
                                      first, zeros, 0, cc, jc + jr, MR, cols)
    tile_end()
    return direct


@jit
def qconv_taps_blocks(x, x_words, blocks, conv, widening, weights, epilogue, out, codes, summed,
                      scratch, gate):
    """A quantized convolution's blocks of output on the taps kernel, in one call: per
    block, the input rows it reads widened once (:func:`widen_rows`), then per chunk
    of its pixels each group's sums (:func:`qconv_taps`) and the epilogue into
    ``out`` (``kernels/requant.py``) while the sums are in cache.  One thread's
    share, run without the GIL from start to end.

    ``x_words``: ``x`` as int32 words when its rows are already what widening would
    make (a uint8 NHWC input of whole words, no padding, a byte kind), and any words
    after them in the same buffer: the rows are read where they lie, except by the
    pixels whose amx tiles would read past its end (the last image's last rows),
    which take widened rows; else empty.

    ``blocks``: rows ``(image, p0, p1, j0, j1)``: output pixels ``p0:p1`` and each
    group's output channels ``j0:j1``.  ``conv = (Wo, kh, kw, sy, sx, dy, dx, top,
    left, Wp, Cw, nchw)``: output width, kernel, stride, dilation, padding, padded
    width, words per widened pixel, whether ``x`` and ``out`` are NCHW.  ``widening
    = (add, pad)`` of :func:`widen_rows`.  ``weights = (words, starts, cgw, cc,
    (KC, MC, NC))``: every group's panels one after another, group ``g``'s from
    ``starts[g]``, its words of channels per pixel, its column corrections
    ``cc[g*Kg:(g+1)*Kg]``.  ``epilogue = (mult, bias, act, requant, folded)`` as
    ``kernels/requant.py`` takes them.  ``codes = (mult, bias, lim)``: the
    requantization as the codes tile takes it (per channel), for the tiles to write the
    codes wherever a group's k is one block (an NHWC output, the requantization
    folded), else the epilogue does.  ``summed = (residual, scales, zeros, relu, low, high,
    conv_first)``: an NHWC ``residual``'s codes (flat) and a QDQ sum's
    quantization as :func:`~tilegemm.kernels.requant.add_codes` takes it: each
    chunk's codes go to ``dest``, then ``out`` = their sum with the residual's,
    the conv's operand first with ``conv_first``; an empty ``residual``: none.
    ``scratch = (words, values, acc, zeros, offsets, chunk, dest, tiles)``: the
    widened rows as words and as values, room for the sums of ``chunk`` pixels,
    :func:`qconv_taps`'s buffers (``offsets``: its ``seg`` then its ``a_at``), where
    the codes go (``out`` flat, or with a residual room for a chunk's codes), and
    ``dest`` again where the tiles write the codes, else an empty byte array.
    ``gate``: an int64 array whose element 0 is set to 1 on entry, once the GIL is let
    go: a caller that hands shares to the pool waits for it before it runs its own
    (``kernels/pool.py``), so that neither thread sleeps waiting for the GIL.
    """
    publish(gate, 0, 1)
    Wo, kh, kw, sy, sx, dy, dx, top, left, Wp, Cw, nchw = conv
    words, values, acc, zeros, offsets, chunk, dest, tiles = scratch
    # rows an amx call reads past its last pixel's (none for the vector tiles)
    past = amx_rows_past(Wp, Wo, (kw, dx), (sy, sx)) if KSTEP > 1 else 0
    finish, more = (epilogue, codes, summed), (acc, zeros, offsets, dest, tiles)
    for b in range(blocks.shape[0]):
        n, p0, p1, j0, j1 = blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3], blocks[b, 4]
        ps = p0             # pixels p0:ps read in place, ps:p1 from widened rows
        if x_words.size > 0:
            ps = in_place_end(x_words.size // (Wp * Cw) - n * x.shape[1], (p0, p1),
                              (Wo, kh, sy, dy, Wp, sx), past, KSTEP > 1)
            r0 = (p0 // Wo) * sy
            _taps_pixels(x_words[(n * x.shape[1] + r0) * Wp * Cw:], r0, (n, p0, ps, j0, j1),
                         conv, weights, finish, out, more, chunk)
        if ps < p1:
            r0 = (ps // Wo) * sy
            r1 = ((p1 - 1) // Wo) * sy + (kh - 1) * dy + 1
            widen_rows(x, n, (top, left, Wp, GROUP * Cw), widening[0], widening[1], r0, r1,
                       values, nchw)
            _taps_pixels(words, r0, (n, ps, p1, j0, j1), conv, weights, finish, out, more, chunk)


@jit
def _taps_pixels(rows, r0, part, conv, weights, finish, out, scratch, chunk):
    """:func:`qconv_taps_blocks` on output pixels ``q0:q1`` of image ``n`` (``part =
    (n, q0, q1, j0, j1)``) whose input rows ``rows`` hold from row ``r0``, a chunk of
    ``chunk`` pixels at a time (``finish = (epilogue, codes, summed)``)."""
    n, q0, q1, j0, j1 = part
    epilogue, codes, summed = finish
    for c0 in range(q0, q1, chunk):
        piece = (n, c0, min(c0 + chunk, q1), j0, j1)
        _taps_chunk(rows, piece, conv, r0, weights, (epilogue, codes, summed[0].size > 0), out,
                    scratch)
        if summed[0].size > 0:
            add_residual(scratch[3], piece, weights[1].size - 1, summed, out)


@jit
def _taps_chunk(words, part, conv, r0, weights, finish, out, scratch):
    """:func:`qconv_taps_blocks` on output pixels ``q0:q1`` of image ``n`` (``part =
    (n, q0, q1, j0, j1)``) whose input rows are widened in ``words`` from row ``r0``:
    every group's sums into ``acc``, then the epilogue; or the codes written by the
    tiles (``finish = (epilogue, codes, apart)``).  The codes go to ``dest``
    (``scratch = (acc, zeros, offsets, dest, tiles)``, ``tiles`` ``dest`` where the
    tiles write them, else empty): ``out`` flat, or with ``apart`` a chunk of NHWC
    pixels from its start."""
    Wo, kh, kw, sy, sx, dy, dx, top, left, Wp, Cw, nchw = conv
    panels, starts, cgw, cc, sizes = weights
    epilogue, (mult, bias, lim), apart = finish
    acc, zeros, offsets, dest, tiles = scratch
    n, q0, q1, j0, j1 = part
    groups = starts.size - 1
    K = epilogue[0].size
    Kg = K // groups
    P = out.shape[2] * out.shape[3] if nchw else out.shape[1] * out.shape[2]
    flat = out.reshape(-1)
    m = q1 - q0
    nseg = 2 * (kh * kw + 1)
    sums = acc[:m * Kg]
    base = 0 if apart else (n * P + q0) * K
    for g in range(groups):
        group = (tiles, base + g * Kg, K, mult[g * Kg:(g + 1) * Kg], bias[g * Kg:(g + 1) * Kg],
                 lim)
        if qconv_taps(words, (Wp, Cw, Wo, kh, kw, sy, sx, dy, dx, r0), (g * cgw, cgw, Kg),
                      panels[starts[g]:starts[g + 1]], sizes, sums, (q0, q1, j0, j1), zeros,
                      cc[g * Kg:(g + 1) * Kg], offsets[:nseg], offsets[nseg:], group):
            continue
        k0 = g * Kg + j0
        if nchw:
            finish_planes(sums[j0:], Kg, epilogue, k0, flat, (n * K + k0) * P + q0, P,
                          (m, j1 - j0))
        else:
            finish_rows(sums, j0, Kg, epilogue, k0, dest, base + k0, K, (m, j1 - j0))
