"""Winograd F(2x2, 3x3): the transforms, written as packing and unpacking routines.

For a 4x4 input tile ``d`` and a 3x3 filter ``g`` the 2x2 output tile is::

    Y = A^T [ (G g G^T) * (B^T d B) ] A        (* element-wise over the 4x4 = 16 positions)

With ``U = G g G^T`` (per output channel k and input channel c) and
``V = B^T d B`` (per channel c and tile t), position ``xi`` of the element-wise
product summed over channels is a GEMM::

    M[xi][t, k] = sum_c V[xi][t, c] * U[xi][c, k]          xi = 0..15

so the 16 products run on the engine's micro-kernels.  The tiles are the GEMM's
rows (A operand) and output channels its columns (B operand):

* :func:`weight_transform` computes every ``U`` (the reference layout) and
  :func:`pack_filter_transforms` writes them straight into packed panels, once per
  weight array (the caller caches them).
* :func:`pack_a_winograd` computes ``V`` for a block of tiles and writes it straight
  into 16 packed-A slabs (MR-row k-major micro-panels), so the transformed input
  is never stored in any other layout.  Tiles that overhang the image read zeros;
  nothing is padded or copied beforehand.
* :func:`unpack_winograd` applies ``A^T m A`` to the GEMM results, adds the bias,
  applies the activation and writes the 2x2 tiles into the output (dropping the
  overhang at the right and bottom edges): the epilogue is fused into the output
  transform, not a separate pass.

Image strides and offsets follow :mod:`tilegemm.packing.im2col`; ``geom`` here is
``(H, W, Ho, Wo, py, px, TH, TW)`` with ``TH, TW = ceil(Ho/2), ceil(Wo/2)`` tiles.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import EPI_RELU, EPI_RELU6, JIT, imin, inner_jit, round_up
from tilegemm.packing.cook_toom import matrices

#: Input transform: V = BT @ d @ BT.T
BT = np.array([[1, 0, -1, 0],
               [0, 1, 1, 0],
               [0, -1, 1, 0],
               [0, 1, 0, -1]], dtype=np.float64)

#: Filter transform: U = G @ g @ G.T
G = np.array([[1, 0, 0],
              [0.5, 0.5, 0.5],
              [0.5, -0.5, 0.5],
              [0, 0, 1]], dtype=np.float64)

#: Output transform: Y = AT @ m @ AT.T
AT = np.array([[1, 1, 1, 0],
               [0, 1, -1, -1]], dtype=np.float64)


def transform_matrices(tile):
    """``(AT, G, BT)`` of F(tile x tile, 3x3) as the library applies them (float64).

    F(2x2) is the hand-written set above; larger tiles are built by
    :func:`tilegemm.packing.cook_toom.matrices` from their published points.  The
    NCHW vector transforms and the weight packing both read them here.
    """
    if tile == 2:
        return AT, G, BT
    return matrices(tile)


def weight_transform(weight):
    """``U[xi] = (G g G^T)`` for every filter, as 16 matrices of shape (C, K).

    Parameters
    ----------
    weight : ndarray, shape (K, C, 3, 3)

    Returns
    -------
    ndarray, shape (16, C, K), C-contiguous, dtype of ``weight``
        ``U[4*a + b, c, k] = (G @ weight[k, c] @ G.T)[a, b]``.
    """
    return np.ascontiguousarray(filter_transforms(weight).transpose(2, 1, 0))


def filter_transforms(weight):
    """Each filter's ``G g G^T`` flattened: shape (K, C, 16), ``[k, c, 4*a + b]``.

    In numpy, whole arrays at a time: G applied down the filters' columns, then
    along each row, over every (k, c) at once.  A jitted loop would cost a compile
    of its own in a cold process (a third of a second) for work done once per
    weight array.
    """
    w = np.asarray(weight)
    h = w.dtype.type(0.5)
    out = np.empty(w.shape[:2] + (4, 4), w.dtype)
    for a, col in enumerate(_g_rows(w[:, :, 0, :], w[:, :, 1, :], w[:, :, 2, :], h)):
        for b, value in enumerate(_g_rows(col[..., 0], col[..., 1], col[..., 2], h)):
            out[:, :, a, b] = value
    return out.reshape(w.shape[0], w.shape[1], 16)


def tile_filter_transforms(weight, tile):
    """Each filter's ``G g G^T`` of F(tile x tile, 3x3) flattened: shape (K, C, alpha^2),
    ``[k, c, alpha*a + b]`` with ``alpha = tile + 2``.

    F(2x2) is :func:`filter_transforms`; larger tiles use the matrices of
    :mod:`tilegemm.packing.cook_toom`, applied in float64 and rounded once to the
    weight's dtype (their G has entries such as 1/6 and 1/90 that float32 products
    would round at every step).
    """
    if tile == 2:
        return filter_transforms(weight)
    w = np.asarray(weight)
    _, g_mat, _ = transform_matrices(tile)
    u = np.einsum("ai,kcij,bj->kcab", g_mat, w.astype(np.float64), g_mat, optimize=True)
    return u.reshape(w.shape[0], w.shape[1], -1).astype(w.dtype)


def pack_filter_transforms(weight, KC, R, tile=2):
    """The alpha^2 (C x K) matrices ``U[xi]`` of F(tile x tile, 3x3), packed (alpha =
    tile + 2; 16 for the default F(2x2), those of :func:`weight_transform`).

    R-wide micro-panels along K, k-major, per KC block of C: block (xi, pc) at
    ``(xi*C + pc)*Kp`` (``Kp`` = K rounded up to R, the padding zero), panel ``j``
    of it at ``j*R*kc``, value (c, r) at ``c*R + r``.  That is packed B of each
    ``U[xi]`` with NR = R, and packed A of its transpose with MR = R.

    Returns ``(buffer, Kp)``; the buffer has one spare element at its end.  One
    strided copy per KC block, all 16 matrices at once (a copy per matrix and
    block costs Python overhead that outweighs the work).
    """
    K, C = weight.shape[:2]
    Kp = round_up(K, R)
    positions = (tile + 2) ** 2
    u = np.zeros((positions, C, Kp), weight.dtype)
    u[:, :, :K] = tile_filter_transforms(weight, tile).transpose(2, 1, 0)
    buf = np.zeros(positions * C * Kp + 1, weight.dtype)
    blocks = buf[:-1].reshape(positions, C * Kp)
    for pc in range(0, C, KC):
        kc = min(KC, C - pc)
        panels = u[:, pc:pc + kc].reshape(positions, kc, Kp // R, R).transpose(0, 2, 1, 3)
        blocks[:, pc * Kp:(pc + kc) * Kp].reshape(positions, Kp // R, kc, R)[...] = panels
    return buf, Kp


def _g_rows(x0, x1, x2, h):
    """One 1-D weight transform ``G x`` over three values or arrays (G's rows: e0,
    (e0+e1+e2)/2, (e0-e1+e2)/2, e2); ``h`` is 0.5 in the values' dtype."""
    half = (x0 + x2) * h
    return x0, half + x1 * h, half - x1 * h, x2


@numba.njit(inline="always", **JIT)
def _rows(d0, d1, d2, d3):
    """One 1-D input transform ``B^T d`` over four values."""
    return d0 - d2, d1 + d2, d2 - d1, d1 - d3


@inner_jit
def input_tile_transform(x, src, s_row, s_col, y0, x0, H, W, v):
    """``V = B^T d B`` for the 4x4 tile whose top-left input pixel is (y0, x0); writes v[0:16].

    ``src`` is the offset of the tile's top-left pixel (it may lie outside the image,
    whose pixels read as zero).  ``v`` is a 16-element scratch.
    """
    inside = y0 >= 0 and x0 >= 0 and y0 + 4 <= H and x0 + 4 <= W
    # Columns first: t[r][:] = B^T applied down each column of d.
    for b in range(4):
        if inside:
            c0 = x[src + b * s_col]
            c1 = x[src + s_row + b * s_col]
            c2 = x[src + 2 * s_row + b * s_col]
            c3 = x[src + 3 * s_row + b * s_col]
        else:
            c0 = c1 = c2 = c3 = x.dtype.type(0)
            xb = x0 + b
            if 0 <= xb < W:
                if 0 <= y0 < H:
                    c0 = x[src + b * s_col]
                if 0 <= y0 + 1 < H:
                    c1 = x[src + s_row + b * s_col]
                if 0 <= y0 + 2 < H:
                    c2 = x[src + 2 * s_row + b * s_col]
                if 0 <= y0 + 3 < H:
                    c3 = x[src + 3 * s_row + b * s_col]
        t0, t1, t2, t3 = _rows(c0, c1, c2, c3)
        v[b] = t0
        v[4 + b] = t1
        v[8 + b] = t2
        v[12 + b] = t3
    # Then along each row: V[a][:] = t[a][:] B.
    for a in range(4):
        r0, r1, r2, r3 = _rows(v[4 * a], v[4 * a + 1], v[4 * a + 2], v[4 * a + 3])
        v[4 * a] = r0
        v[4 * a + 1] = r1
        v[4 * a + 2] = r2
        v[4 * a + 3] = r3


@inner_jit
def _transform_run(x, src, xs, tiles, channels, MR, buf, slab, dst, strip):
    """``V`` for ``count`` horizontally adjacent tiles lying wholly inside the image.

    ``xs`` is ``(sc, s_row, s_col)`` (the image's strides), ``tiles`` ``(i0, count)``,
    ``channels`` ``(p0, kc)``.  The tiles share their 4 input rows: ``B^T`` is applied once down each column of the
    4 x (2*count + 2) strip (a vectorisable loop along the row), then ``B`` across each
    tile's 4 columns.  Results go to rows ``i0:i0+count`` of each slab's panel at ``dst``.
    ``strip`` holds 4 * (2*MR + 2) elements.
    """
    sc, s_row, s_col = xs
    i0, count = tiles
    p0, kc = channels
    width = 2 * count + 2
    ld = 2 * MR + 2
    for p in range(kc):
        base = src + (p0 + p) * sc
        for col in range(width):
            d0 = x[base + col * s_col]
            d1 = x[base + s_row + col * s_col]
            d2 = x[base + 2 * s_row + col * s_col]
            d3 = x[base + 3 * s_row + col * s_col]
            strip[col] = d0 - d2
            strip[ld + col] = d1 + d2
            strip[2 * ld + col] = d2 - d1
            strip[3 * ld + col] = d1 - d3
        out = dst + p * MR + i0
        for a in range(4):
            row = a * ld
            for i in range(count):
                e0 = strip[row + 2 * i]
                e1 = strip[row + 2 * i + 1]
                e2 = strip[row + 2 * i + 2]
                e3 = strip[row + 2 * i + 3]
                buf[(4 * a) * slab + out + i] = e0 - e2
                buf[(4 * a + 1) * slab + out + i] = e1 + e2
                buf[(4 * a + 2) * slab + out + i] = e2 - e1
                buf[(4 * a + 3) * slab + out + i] = e1 - e3


@inner_jit
def pack_a_winograd(x, x_off, xs, geom, t0, mt, p0, kc, MR, buf, slab, v):
    """Transform channels ``p0:p0+kc`` of tiles ``t0:t0+mt`` into 16 packed-A slabs.

    Tile ``t`` is ``(n, ty, tx)`` with ``t = (n*TH + ty)*TW + tx`` across the batch.
    Slab ``xi`` starts at ``buf[xi*slab]`` and holds ``V[xi][t0:t0+mt, p0:p0+kc]`` as
    ``ceil(mt/MR)`` MR-row k-major micro-panels, zero padded.  ``v``: scratch of
    ``16 + 4*(2*MR + 2)`` elements.
    """
    H, W, Ho, Wo, py, px, TH, TW = geom
    sn, sc, s_row, s_col = xs
    tiles = TH * TW
    strip = v[16:]
    for ir in range(0, mt, MR):
        rows = imin(MR, mt - ir)
        base = ir * kc
        for i in range(rows, MR):
            for p in range(kc):
                for xi in range(16):
                    buf[xi * slab + base + p * MR + i] = 0
        i = 0
        while i < rows:
            t = t0 + ir + i
            n = t // tiles
            ty = (t % tiles) // TW
            tx = t % TW
            y0 = 2 * ty - py
            x0 = 2 * tx - px
            src = x_off + n * sn + y0 * s_row + x0 * s_col
            # Tiles of this tile row that lie wholly inside the image go through the strip.
            run = 0
            if y0 >= 0 and y0 + 4 <= H and x0 >= 0:
                while (i + run < rows and tx + run < TW
                       and x0 + 2 * run + 4 <= W):
                    run += 1
            if run > 0:
                _transform_run(x, src, (sc, s_row, s_col), (i, run), (p0, kc), MR, buf, slab,
                               base, strip)
                i += run
                continue
            for p in range(kc):
                input_tile_transform(x, src + (p0 + p) * sc, s_row, s_col, y0, x0, H, W, v)
                dst = base + p * MR + i
                for xi in range(16):
                    buf[xi * slab + dst] = v[xi]
            i += 1


@numba.njit(inline="always", **JIT)
def activate(y, act):
    """``y`` through the activation of epilogue flags ``act`` (relu, relu6, or none).

    Compare-and-assign keeps NaN (NaN < 0 is false), as torch's relu does."""
    if act & (EPI_RELU | EPI_RELU6) and y < 0:
        y = 0
    if act & EPI_RELU6 and y > 6:
        y = 6
    return y


@inner_jit
def unpack_winograd(m, layout, tiles, K, out, o_off, os, geom, epilogue):
    """Output transform ``Y = A^T m A`` + bias + activation for tiles ``t0:t0+mt``.

    ``layout`` is ``(slab, ldm)``, ``tiles`` ``(t0, mt)``, ``epilogue`` ``(bias,
    has_bias, act)``.  ``m[xi*slab + i*ldm + k]`` is ``M[xi][t0+i, k]``.  ``out`` is flat with element
    strides ``os = (sn, sk, sy, sx)``; ``o_off`` is the offset of output channel 0.
    Rows and columns beyond ``Ho``/``Wo`` (the edge tiles' overhang) are not written.
    ``bias`` has K values and is read only when ``has_bias``.
    """
    slab, ldm = layout
    t0, mt = tiles
    bias, has_bias, act = epilogue
    H, W, Ho, Wo, py, px, TH, TW = geom
    sn, sk, s_row, s_col = os
    tiles = TH * TW
    for i in range(mt):
        t = t0 + i
        n = t // tiles
        oy = 2 * ((t % tiles) // TW)
        ox = 2 * (t % TW)
        two_rows = oy + 1 < Ho
        two_cols = ox + 1 < Wo
        dst = o_off + n * sn + oy * s_row + ox * s_col
        src = i * ldm
        for k in range(K):
            q = src + k
            m0, m1, m2, m3 = m[q], m[q + slab], m[q + 2 * slab], m[q + 3 * slab]
            m4, m5, m6, m7 = m[q + 4 * slab], m[q + 5 * slab], m[q + 6 * slab], m[q + 7 * slab]
            m8, m9, m10, m11 = m[q + 8 * slab], m[q + 9 * slab], m[q + 10 * slab], m[q + 11 * slab]
            m12, m13, m14, m15 = (m[q + 12 * slab], m[q + 13 * slab], m[q + 14 * slab],
                                  m[q + 15 * slab])
            # A^T m: rows 0+1+2 and 1-2-3 of the 4x4 block.
            a0 = m0 + m4 + m8
            a1 = m1 + m5 + m9
            a2 = m2 + m6 + m10
            a3 = m3 + m7 + m11
            b0 = m4 - m8 - m12
            b1 = m5 - m9 - m13
            b2 = m6 - m10 - m14
            b3 = m7 - m11 - m15
            # (A^T m) A: the same combination along the columns.
            y00 = a0 + a1 + a2
            y01 = a1 - a2 - a3
            y10 = b0 + b1 + b2
            y11 = b1 - b2 - b3
            if has_bias:
                y00 += bias[k]
                y01 += bias[k]
                y10 += bias[k]
                y11 += bias[k]
            o = dst + k * sk
            out[o] = activate(y00, act)
            if two_cols:
                out[o + s_col] = activate(y01, act)
            if two_rows:
                out[o + s_row] = activate(y10, act)
                if two_cols:
                    out[o + s_row + s_col] = activate(y11, act)
