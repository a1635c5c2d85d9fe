"""Winograd F(m x m, 3x3): the matrices and the weight transform, packed.

For an (m+2)x(m+2) input tile ``d`` and a 3x3 filter ``g`` the m x m output tile is::

    Y = A^T [ (G g G^T) * (B^T d B) ] A        (* element-wise over the (m+2)^2 positions)

With ``U = G g G^T`` (per output channel k and input channel c) and
``V = B^T d B`` (per channel c and tile t), position ``xi`` of the element-wise
product summed over channels is a GEMM::

    M[xi][t, k] = sum_c V[xi][t, c] * U[xi][c, k]          xi = 0..(m+2)^2 - 1

so the products run on the engine's micro-kernels.  This module holds the matrices
(:func:`transform_matrices`: F(2x2)'s written out below, larger tiles from
:mod:`tilegemm.packing.cook_toom`) and the weight side: :func:`weight_transform`
computes every ``U`` of F(2x2) (the reference layout) and
:func:`pack_filter_transforms` writes any tile size's straight into packed panels,
once per weight array and tile size (the caller caches them).  The input and output
transforms are vector code generated from the same matrices
(:mod:`tilegemm.kernels.winograd`).
"""
import numpy as np

from tilegemm.ground.contracts import round_up
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
    return position_transforms(weight, tile).transpose(2, 1, 0)


def position_transforms(weight, tile, product=np.matmul):
    """The alpha^2 matrices ``U[xi]`` (C x K) of F(tile x tile, 3x3): shape (alpha^2, C,
    K), ``[alpha*a + b, c, k] = (G g_kc G^T)[a, b]``, C-contiguous.

    One matrix product with G's Kronecker square, ``(G (x) G)`` (alpha^2 x 9), over the
    filters laid out (9, C*K): the layout the packing reads, and a single GEMM
    (``product(a, b)``; the convolution passes tilegemm's own, whose threads follow
    tilegemm's limit where numpy's BLAS would start its own) where a per-filter
    contraction took seconds on VGG's weights.  Larger tiles are computed in float64
    and rounded once (see :func:`tile_filter_transforms`).
    """
    w = np.asarray(weight)
    if tile == 2:
        return np.ascontiguousarray(filter_transforms(w).transpose(2, 1, 0))
    K, C = w.shape[:2]
    _, g_mat, _ = transform_matrices(tile)
    # The strided transpose in the weight's own dtype, the conversions contiguous.
    taps = np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(9, C * K)
    u = product(np.kron(g_mat, g_mat), taps.astype(np.float64))
    return u.astype(w.dtype).reshape(-1, C, K)


#: Bytes of float64 transforms computed at a time while packing: a chunk of input
#: channels stays in cache between the product and its copy into the panels.
#: Whole layers at once wrote VGG-11's 1M filters' F(6x6) transforms (0.5 GB in
#: float64, then float32 copies of them) before packing: 1.5 s of its first run.
PACK_CHUNK_BYTES = 1 << 21


def pack_filter_transforms(weight, KC, R, tile=2, product=np.matmul):
    """The alpha^2 (C x K) matrices ``U[xi]`` of F(tile x tile, 3x3), packed (alpha =
    tile + 2; 16 for the default F(2x2), those of :func:`weight_transform`).

    R-wide micro-panels along K, k-major, per KC block of C: block (xi, pc) at
    ``(xi*C + pc)*Kp`` (``Kp`` = K rounded up to R, the padding zero), panel ``j``
    of it at ``j*R*kc``, value (c, r) at ``c*R + r``.  That is packed B of each
    ``U[xi]`` with NR = R, and packed A of its transpose with MR = R.

    Returns ``(buffer, Kp)``; the buffer has one spare element at its end.  The
    transforms are computed a few input channels at a time
    (:data:`PACK_CHUNK_BYTES`), each chunk copied into its panels for all alpha^2
    matrices at once; ``product`` computes the larger tiles' transforms
    (:func:`position_transforms`).
    """
    K, C = weight.shape[:2]
    Kp = round_up(K, R)
    positions = (tile + 2) ** 2
    buf = np.zeros(positions * C * Kp + 1, weight.dtype)
    blocks = buf[:-1].reshape(positions, C * Kp)
    step = max(1, PACK_CHUNK_BYTES // (positions * Kp * 8))
    u = np.zeros((positions, min(step, C), Kp), weight.dtype)    # the padding stays zero
    for pc in range(0, C, KC):
        kc = min(KC, C - pc)
        panels = blocks[:, pc * Kp:(pc + kc) * Kp].reshape(positions, Kp // R, kc, R)
        for c0 in range(0, kc, step):
            cs = min(step, kc - c0)
            u[:, :cs, :K] = position_transforms(weight[:, pc + c0:pc + c0 + cs], tile, product)
            panels[:, :, c0:c0 + cs] = u[:, :cs].reshape(positions, cs, Kp // R, R).transpose(
                0, 2, 1, 3)
    return buf, Kp


def _g_rows(x0, x1, x2, h):
    """One 1-D weight transform ``G x`` over three values or arrays (G's rows: e0,
    (e0+e1+e2)/2, (e0-e1+e2)/2, e2); ``h`` is 0.5 in the values' dtype."""
    half = (x0 + x2) * h
    return x0, half + x1 * h, half - x1 * h, x2
