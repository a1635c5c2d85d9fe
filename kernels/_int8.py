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
from tilegemm.kernels.int8 import load_u64, make_int8_tile, store_u64
from tilegemm.kernels.requant import add_codes, finish_planes, finish_rows

# --- configuration ---
KIND = "vnni"
BITS = 512
MR = 6
NR = 64
GROUP = 4
# --- end configuration ---

tile = make_int8_tile(KIND, BITS, MR, NR)


@jit
def pack_a(a, i0, mc, p0, kc, a_add, out):
    """Rows ``i0:i0+mc`` and columns ``p0:p0+kc`` of A, plus ``a_add``, into panels of
    MR rows: per group of GROUP k values, MR words (row-major within a panel)."""
    kg = (kc + GROUP - 1) // GROUP
    whole = kc // GROUP
    for ir in range(0, mc, MR):
        base = (ir // MR) * kg * MR * GROUP
        rows = min(MR, mc - ir)
        for g in range(kg):
            at = base + g * MR * GROUP
            if g < whole and rows == MR:   # the common case, with no test per value
                for i in range(MR):
                    for t in range(GROUP):
                        out[at + i * GROUP + t] = a[i0 + ir + i, p0 + g * GROUP + t] + a_add
            else:
                _edge_group(a, i0 + ir, p0, MR, rows, kc, g, a_add, out, at)


@jit
def pack_a_words(a_words, i0, mc, g0, kg, flip, out):
    """:func:`pack_a` for the byte kinds when A's rows are whole 32-bit words (k a multiple of 4,
    rows contiguous): ``a_words`` is A viewed as words, and a word of A is a word of the
    panel, ``^ flip`` (0x80808080 adds 128 to every byte of an int8 A).  Groups
    ``g0:g0+kg``; rows past ``mc`` are zero.  Three times faster than byte by byte."""
    for ir in range(0, mc, MR):
        base = (ir // MR) * kg * MR
        for i in range(MR):
            o = out[base + i:]
            if ir + i < mc:
                row = a_words[i0 + ir + i, g0:g0 + kg]
                for g in range(kg):
                    o[g * MR] = row[g] ^ flip
            else:
                for g in range(kg):
                    o[g * MR] = 0


@jit
def pack_b(b, p0, kc, j0, nc, b_add, out):
    """Rows ``p0:p0+kc`` and columns ``j0:j0+nc`` of B, plus ``b_add``, into panels of
    NR columns: per group of GROUP k values, NR words, column j's values in word j."""
    kg = (kc + GROUP - 1) // GROUP
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
            _edge_group(b.T, j0 + jr, p0, NR, width, kc, g, b_add, out, base + g * NR * GROUP)


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
            at += (nc + NR - 1) // NR * NR * ((kc + GROUP - 1) // GROUP)


@jit
def _edge_group(m, r0, k0, lines, valid, kc, g, add, out, at):
    """Group ``g`` of a panel's ``lines`` words at ``out[at:]``, line ``i``'s from row
    ``r0 + i`` of ``m`` (columns ``k0 + g*GROUP`` on), plus ``add``; zero past the
    ``valid`` lines and past column ``kc``: the edge of a panel of A or of B."""
    for i in range(lines):
        for t in range(GROUP):
            p = g * GROUP + t
            inside = i < valid and p < kc
            out[at + i * GROUP + t] = m[r0 + i, k0 + p] + add if inside else 0


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
        for p in range(k):
            for j in range(n):
                cc[j] += b[p, j] + b_add
        for j in range(n):
            cc[j] = -alpha * cc[j]


@jit
def qgemm(a, b, c, c_at, adds, blocks, packs, rc, cc, a_words, b_panels):
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
    packed here, block by block.
    """
    m, k = a.shape
    n = b.shape[1]
    c_off, ldc = c_at
    KC, MC, NC = blocks
    apack, apack_values, bpack, bpack_values = packs
    words, a_flat, lda = a_words
    # Only the byte kinds pass words, and there adds[0] is 128 exactly when A is int8: its
    # words are flipped into a panel; a uint8 A's are read where they lie.
    flip = np.uint32(0x80808080) if adds[0] == 128 else np.uint32(0)
    in_place = words.size > 0 and adds[0] == 0
    at = 0                                    # the next block in b_panels, in words
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, max(k, 1), KC):    # k == 0 still writes C once (the corrections)
            kc = min(KC, k - pc)
            kg = (kc + GROUP - 1) // GROUP
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
                    _macro(kg, (apack, 0, 1, MR), b_src, c, c_block, rc, cc, mc, nc)


@jit
def _macro(kg, a_src, b_src, c, c_block, rc, cc, mc, nc):
    """The tiles of one mc x nc block of C (the jr and ir loops) over ``kg`` groups of
    k: A from ``a_src = (a, at, rs, gs)`` (its packed panels, ``rs = 1, gs = MR``, or
    its words in place, ``rs`` = the row stride, ``gs = 1``), B's panels from
    ``b_src``; ``c_block = (offset, ldc, first, ic, jc)``: the block's first value in
    ``c``, as the tile takes them, and its first row and column for the corrections."""
    a, a_at, a_rs, a_gs = a_src
    c_at, ldc, first, ic, jc = c_block
    for jr in range(0, nc, NR):
        for ir in range(0, mc, MR):
            tile(kg, a, a_at + (ir * a_rs if a_gs == 1 else (ir // MR) * kg * MR), a_rs, a_gs,
                 b_src, (jr // NR) * kg * NR, c, c_at + ir * ldc + jr, ldc, first, rc, ic + ir,
                 cc, jc + jr, min(MR, mc - ir), min(NR, nc - jr))


tile_taps = make_int8_tile(KIND, BITS, MR, NR, taps=True)
tile_codes = make_int8_tile(KIND, BITS, MR, NR, taps=True, codes=True)


@jit
def widen_rows(x, n, geom, add, pad, r0, r1, out, nchw):
    """Rows ``r0:r1`` of image ``n`` of the input ``x`` (NCHW with ``nchw``, else NHWC)
    padded with ``pad``, as channels-last values ``x + add`` of ``out``'s dtype:
    ``out[((r - r0) * Wp + col) * Cp + c]`` for row ``r`` and column ``col`` of the
    padded image (``geom = (py, px, Wp, Cp)``), the taps kernel's A.  GROUP channels
    are its 32-bit words: ``Cp`` is C, or C rounded up to GROUP with zero channels.
    int16 ``x - zero`` padded with 0 for the pair kinds; bytes ``x + 128`` (int8) or
    ``x`` (uint8) padded with the zero point's byte for the byte kinds."""
    H, W = (x.shape[2], x.shape[3]) if nchw else (x.shape[1], x.shape[2])
    py, px, Wp, Cp = geom
    add = np.int16(add)
    for r in range(r0, r1):
        row = out[(r - r0) * Wp * Cp:(r - r0 + 1) * Wp * Cp]
        iy = r - py
        if not 0 <= iy < H:
            row[:] = pad
            continue
        row[:px * Cp] = pad
        row[(px + W) * Cp:] = pad
        body = row[px * Cp:(px + W) * Cp]
        if nchw:
            _pixels_from_nchw(x, n, iy, add, body, Cp)
        else:
            _pixels_from_nhwc(x[n, iy].reshape(-1), x.shape[3], add, body, Cp)


@jit
def _pixels_from_nhwc(src, C, add, body, Cp):
    """``body``: the ``C``-channel pixels of the run ``src`` plus ``add``, ``Cp``
    values apart."""
    if Cp == C:     # one run: the loop vectorises
        for i in range(src.size):
            body[i] = np.int16(src[i]) + add
    else:           # no slices per pixel: they cost more than the values
        for j in range(src.size // C):
            for c in range(Cp):
                body[j * Cp + c] = np.int16(src[j * C + c]) + add if c < C else 0


@jit
def _pixels_from_nchw(x, n, iy, add, body, Cp):
    """``body``: the pixels of row ``iy`` of image ``n`` of the NCHW ``x``, transposed
    while widened (no channels-last copy of the input first).  Bytes (the byte kinds)
    go as 8 x 8 blocks of 64-bit words (:func:`_bytes_from_nchw`: ResNet-50's 1x1
    input, 256 x 56 x 56, 0.43 -> 0.22 ms); the rest pixel by pixel, its channels
    written in a run (the reads stride across the channels' planes, but each line
    read serves the next pixels: 1.5x faster than channel by channel)."""
    C, W = x.shape[1], x.shape[3]
    j8, c8 = (W // 8 * 8, C // 8 * 8) if body.itemsize == 1 else (0, 0)
    if j8 > 0 and c8 > 0:
        _bytes_from_nchw(x, n, iy, add != 0, body, Cp, (j8, c8))
    else:
        j8 = 0
    for j in range(W):
        pixel = body[j * Cp:(j + 1) * Cp]
        for c in range(c8 if j < j8 else 0, C):
            pixel[c] = np.int16(x[n, c, iy, j]) + add
        for c in range(C, Cp):
            pixel[c] = 0


@numba.njit(inline="always", **JIT)
def _swap_pairs(w, mask, shift):
    """One round of an 8 x 8 byte transpose on the 8 words ``w``: in each pair (w[0],
    w[1]), (w[2], w[3]), ..., the ``mask`` bytes of the second swapped with those of
    the first ``shift`` bits up."""
    t0 = ((w[0] >> shift) ^ w[1]) & mask
    t1 = ((w[2] >> shift) ^ w[3]) & mask
    t2 = ((w[4] >> shift) ^ w[5]) & mask
    t3 = ((w[6] >> shift) ^ w[7]) & mask
    return (w[0] ^ (t0 << shift), w[1] ^ t0, w[2] ^ (t1 << shift), w[3] ^ t1,
            w[4] ^ (t2 << shift), w[5] ^ t2, w[6] ^ (t3 << shift), w[7] ^ t3)


@jit
def _bytes_from_nchw(x, n, iy, flip, body, Cp, extent):
    """``body[j*Cp + c] = x[n, c, iy, j] (^ 0x80 with flip)`` for pixels and channels
    below ``extent = (j8, c8)`` (multiples of 8), uint8 ``body``: each block of 8
    channels x 8 pixels read as eight 64-bit words (a channel's 8 pixels each),
    transposed in registers by three rounds of swaps (bytes, pairs, quads between
    words 1, 2 and 4 apart) into each pixel's 8 channels, written as eight words."""
    j8, c8 = extent
    W = x.shape[3]
    plane = x.shape[2] * W
    src = x.reshape(-1)
    base = (n * x.shape[1] * x.shape[2] + iy) * W
    flips = np.uint64(0x8080808080808080) if flip else np.uint64(0)
    m1, m2, m4 = np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF), np.uint64(0xFFFFFFFF)
    s1, s2, s4 = np.uint64(8), np.uint64(16), np.uint64(32)
    for c0 in range(0, c8, 8):
        at = base + c0 * plane
        for j0 in range(0, j8, 8):
            w0, w1 = load_u64(src, at + j0), load_u64(src, at + plane + j0)
            w2, w3 = load_u64(src, at + 2 * plane + j0), load_u64(src, at + 3 * plane + j0)
            w4, w5 = load_u64(src, at + 4 * plane + j0), load_u64(src, at + 5 * plane + j0)
            w6, w7 = load_u64(src, at + 6 * plane + j0), load_u64(src, at + 7 * plane + j0)
            # bytes between words 1 apart, pairs 2 apart, quads 4 apart
            w0, w1, w2, w3, w4, w5, w6, w7 = _swap_pairs((w0, w1, w2, w3, w4, w5, w6, w7), m1, s1)
            w0, w2, w1, w3, w4, w6, w5, w7 = _swap_pairs((w0, w2, w1, w3, w4, w6, w5, w7), m2, s2)
            w0, w4, w1, w5, w2, w6, w3, w7 = _swap_pairs((w0, w4, w1, w5, w2, w6, w3, w7), m4, s4)
            out = j0 * Cp + c0
            for i, w in enumerate((w0, w1, w2, w3, w4, w5, w6, w7)):
                store_u64(body, out + i * Cp, w ^ flips)


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
    for q in range(p0, p1):
        a_at[q - p0] = (((q // Wo) * sy - row0) * Wp + (q % Wo) * sx) * Cw
    k_groups = kh * kw * cgw
    direct = o.size > 0 and k_groups <= KC // GROUP
    at = 0                                    # the next block in b_panels, in words
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for g0 in range(0, k_groups, KC // GROUP):
            g1 = min(g0 + KC // GROUP, k_groups)
            b_src = b_panels[at:]
            at += (nc + NR - 1) // NR * NR * (g1 - g0)
            segs = _tap_runs(g0, g1, cgw, (Wp, Cw, kw, dy, dx), c0w, seg)
            first = 1 if g0 == 0 else 0
            for ic in range(0, p1 - p0, MC):
                mc = min(MC, p1 - p0 - ic)
                for jr in range(max(j0 - jc, 0), min(j1 - jc, nc), NR):
                    cols = min(NR, j1 - jc - jr, nc - jr)
                    for ir in range(0, mc, MR):
                        b_at = (jr // NR) * (g1 - g0) * NR
                        if direct:
                            tile_codes(segs, seg, xw, a_at, ic + ir, b_src, b_at, o,
                                       o_at + (ic + ir) * ldo + jc + jr, ldo, first, zeros, 0,
                                       cc, jc + jr, min(MR, mc - ir), cols, mult, bias, lim)
                        else:
                            tile_taps(segs, seg, xw, a_at, ic + ir, b_src, b_at, c,
                                      (ic + ir) * n + jc + jr, n, first, zeros, 0, cc, jc + jr,
                                      min(MR, mc - ir), cols)
    return direct


@jit
def _tap_runs(g0, g1, cgw, geom, c0w, seg):
    """The runs of groups ``g0:g1`` of k (tap by tap, ``cgw`` groups each) as the taps
    tile reads them: ``seg[2s]`` the run's first word relative to a pixel's, ``seg[2s+1]``
    its groups.  Taps whose words follow on (a kernel row's, all the channels taken,
    no dilation) make one run: a 3-channel stem's 7x7 is 7 runs of 14 groups, not 49
    of 2.  Returns the number of runs."""
    Wp, Cw, kw, dy, dx = geom
    s = 0
    for t in range(g0 // cgw, (g1 - 1) // cgw + 1):
        lo, hi = max(g0, t * cgw), min(g1, (t + 1) * cgw)
        r, q = t // kw, t % kw
        start = (r * dy * Wp + q * dx) * Cw + c0w + lo - t * cgw
        if s > 0 and seg[2 * s - 2] + seg[2 * s - 1] == start:
            seg[2 * s - 1] += hi - lo
        else:
            seg[2 * s] = start
            seg[2 * s + 1] = hi - lo
            s += 1
    return s


@jit
def qconv_taps_blocks(x, x_words, blocks, conv, widening, weights, epilogue, out, codes, summed,
                      scratch):
    """A quantized convolution's blocks of output on the taps kernel, in one call: per
    block, the input rows it reads widened once (:func:`widen_rows`), then per chunk
    of its pixels each group's sums (:func:`qconv_taps`) and the epilogue into
    ``out`` (``kernels/requant.py``) while the sums are in cache.  One thread's
    share, run without the GIL from start to end.

    ``x_words``: ``x`` as int32 words when its rows are already what widening would
    make (a uint8 NHWC input of whole words, no padding, a byte kind): the rows are
    read where they lie; else empty.

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
    """
    Wo, kh, kw, sy, sx, dy, dx, top, left, Wp, Cw, nchw = conv
    words, values, acc, zeros, offsets, chunk, dest, tiles = scratch
    for b in range(blocks.shape[0]):
        n, p0, p1 = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        r0 = (p0 // Wo) * sy
        r1 = ((p1 - 1) // Wo) * sy + (kh - 1) * dy + 1
        if x_words.size > 0:
            rows = x_words[(n * x.shape[1] + r0) * Wp * Cw:]
        else:
            widen_rows(x, n, (top, left, Wp, GROUP * Cw), widening[0], widening[1], r0, r1,
                       values, nchw)
            rows = words
        for q0 in range(p0, p1, chunk):
            part = (n, q0, min(q0 + chunk, p1), blocks[b, 3], blocks[b, 4])
            _taps_chunk(rows, part, conv, r0, weights, (epilogue, codes, summed[0].size > 0), out,
                        (acc, zeros, offsets, dest, tiles))
            if summed[0].size > 0:
                _add_residual(dest, part, weights[1].size - 1, summed, out)


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
                      cc[g * Kg:(g + 1) * Kg], offsets[:nseg], offsets[nseg:nseg + m], group):
            continue
        k0 = g * Kg + j0
        if nchw:
            finish_planes(sums[j0:], Kg, epilogue, k0, flat, (n * K + k0) * P + q0, P,
                          (m, j1 - j0))
        else:
            finish_rows(sums, j0, Kg, epilogue, k0, dest, base + k0, K, (m, j1 - j0))


@jit
def _add_residual(codes, part, groups, summed, out):
    """``out`` = the QDQ sum (:func:`~tilegemm.kernels.requant.add_codes`) of a chunk's
    codes (NHWC pixels ``q0:q1`` of image ``n`` from ``codes``'s start, each group's
    channels ``j0:j1``; ``part = (n, q0, q1, j0, j1)``) and the residual's, both NHWC."""
    residual, scales, zeros, relu, low, high, conv_first = summed
    n, q0, q1, j0, j1 = part
    K = out.shape[3]
    Kg = K // groups
    at = (n * out.shape[1] * out.shape[2] + q0) * K
    flat = out.reshape(-1)
    # whole pixels: one run; else each pixel's run of each group's channels
    runs, width = ((1, (q1 - q0) * K) if j1 - j0 == Kg else ((q1 - q0) * groups, j1 - j0))
    for r in range(runs):
        c = r * K if j1 - j0 == Kg else (r // groups) * K + (r % groups) * Kg + j0
        mine, other = codes[c:c + width], residual[at + c:at + c + width]
        if conv_first:
            add_codes(mine, other, scales, zeros, relu, low, high, flat[at + c:at + c + width])
        else:
            add_codes(other, mine, scales, zeros, relu, low, high, flat[at + c:at + c + width])
