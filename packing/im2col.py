"""im2col: the convolution's patch matrix, explicit (reference) and implicit (packing routines).

A convolution is a GEMM on the *patch matrix* ``col`` of an image: row
``(c, i, j)`` and column ``(oh, ow)`` of ``col`` hold the input value under kernel
tap ``(i, j)`` of channel ``c`` when the kernel sits on output pixel ``(oh, ow)``::

    col[(c, i, j), (oh, ow)] = x[c, oh*sy + i*dy - py, ow*sx + j*dx - px]   (0 outside x)

:func:`im2col` builds that matrix in memory: simple and readable, but it is
``C*kh*kw`` times larger than the output image.  The jitted packers below write
the same numbers straight into the GEMM's packed micro-panels, one KC x NC block
at a time, so the patch matrix never exists (*implicit* im2col) and the extra
memory is the pack buffer whatever the image size:

* :func:`pack_b_im2col` -- NCHW: ``out[K, Ho*Wo] = W[K, C*kh*kw] @ col``; ``col`` is
  the B operand, packed into NR-column k-major micro-panels (k order ``c, i, j``).
* NHWC needs no packer: a row of ``col^T`` under one tap is one input pixel's
  channels, contiguous, so the kernel reads it in place (``tilegemm.conv.im2col``).

Images are described by a flat 1-D array, the element offset of sample 0 /
channel 0, and four element strides ``(sn, sc, sy, sx)`` for batch, channel, row
and column, so the compiled packer takes any layout.  ``geom`` is the tuple
``(H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx)`` (``py``/``px``: top/left padding;
the bottom/right padding is implied by ``Ho``/``Wo``).
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT, imax, imin, inner_jit


def conv_output_size(size, kernel, stride, pad_before, pad_after, dilation):
    """Output length along one axis: ``(size + pads - dilation*(kernel-1) - 1) // stride + 1``."""
    return (size + pad_before + pad_after - dilation * (kernel - 1) - 1) // stride + 1


def im2col(x, kernel_size, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1)):
    """The explicit patch matrix of one CHW image (the readable reference).

    Parameters
    ----------
    x : ndarray, shape (C, H, W)
    kernel_size, stride, dilation : (int, int)
        ``(kh, kw)``, ``(sy, sx)``, ``(dy, dx)``.
    padding : (int, int, int, int)
        ``(top, bottom, left, right)`` zero padding.

    Returns
    -------
    ndarray, shape (C*kh*kw, Ho*Wo)
        Row ``(c*kh + i)*kw + j``, column ``oh*Wo + ow``.
    """
    C, H, W = x.shape
    kh, kw = kernel_size
    sy, sx = stride
    dy, dx = dilation
    top, bottom, left, right = padding
    Ho = conv_output_size(H, kh, sy, top, bottom, dy)
    Wo = conv_output_size(W, kw, sx, left, right, dx)
    padded = np.zeros((C, H + top + bottom, W + left + right), x.dtype)
    padded[:, top:top + H, left:left + W] = x
    col = np.empty((C, kh, kw, Ho, Wo), x.dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dy, i * dy + sy * (Ho - 1) + 1, sy)
            cols = slice(j * dx, j * dx + sx * (Wo - 1) + 1, sx)
            col[:, i, j] = padded[:, rows, cols]
    return col.reshape(C * kh * kw, Ho * Wo)


@numba.njit(inline="always", **JIT)
def row_segments(col, cols, Wo, seg_oh, seg_ow, seg_len):
    """Cut ``cols`` consecutive output pixels from flat index ``col`` at output-row ends.

    Fills (output row, first output column, length) per segment; returns how many.
    """
    nseg = 0
    done = 0
    while done < cols:
        seg_oh[nseg] = col // Wo
        seg_ow[nseg] = col % Wo
        seg_len[nseg] = imin(Wo - seg_ow[nseg], cols - done)
        done += seg_len[nseg]
        col += seg_len[nseg]
        nseg += 1
    return nseg


@inner_jit
def valid_range(start, step, count, limit):
    """``[lo, hi)`` of the ``t < count`` with ``0 <= start + t*step < limit`` (``step > 0``)."""
    lo = 0
    if start < 0:
        lo = (-start + step - 1) // step
    hi = count
    last = limit - 1 - start  # t*step <= last
    if last < 0:
        hi = 0
    elif last // step + 1 < hi:
        hi = last // step + 1
    if hi < lo:
        hi = lo
    return lo, hi


@inner_jit
def pack_b_im2col(x, x_off, xs, geom, p0, kc, j0, nc, NR, buf):
    """Pack rows ``p0:p0+kc`` x columns ``j0:j0+nc`` of one image's patch matrix as packed B.

    Writes ``ceil(nc/NR)`` NR-column k-major micro-panels at ``buf[0:]`` (panel ``q`` at
    ``q*NR*kc``), zero padded.  ``x_off`` is the offset of this image's first channel;
    ``xs = (sn, sc, sy, sx)`` are element strides.  Assumes validated geometry and a
    ``buf`` of ``ceil(nc/NR)*NR*kc`` elements.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    sc, s_row, s_col = xs[1], xs[2], xs[3]
    # A panel's NR columns cross at most NR output rows: describe each crossing once
    # (segment = output row, first output column, length) instead of dividing per k.
    seg_oh = np.empty(NR, np.int64)
    seg_ow = np.empty(NR, np.int64)
    seg_len = np.empty(NR, np.int64)
    contiguous = sx == 1 and s_col == 1
    for jr in range(0, nc, NR):
        cols = imin(NR, nc - jr)
        nseg = row_segments(j0 + jr, cols, Wo, seg_oh, seg_ow, seg_len)
        # Row p0 of the patch matrix is (c, i, j); later rows step j, then i, then c.
        c = p0 // (kh * kw)
        i = (p0 // kw) % kh
        j = p0 % kw
        dst = jr * kc
        for p in range(kc):
            out = dst
            for s in range(nseg):
                seg = seg_len[s]
                ih = seg_oh[s] * sy + i * dy - py
                if ih < 0 or ih >= H:
                    for t in range(seg):
                        buf[out + t] = 0
                else:
                    iw0 = seg_ow[s] * sx + j * dx - px
                    src = x_off + c * sc + ih * s_row + iw0 * s_col
                    if contiguous:
                        lo = imax(0, -iw0)
                        hi = imax(lo, imin(seg, W - iw0))
                    else:
                        lo, hi = valid_range(iw0, sx, seg, W)
                    for t in range(lo):
                        buf[out + t] = 0
                    if contiguous:
                        # The common case: a contiguous run of the image row.
                        for t in range(lo, hi):
                            buf[out + t] = x[src + t]
                    else:
                        step = sx * s_col
                        for t in range(lo, hi):
                            buf[out + t] = x[src + t * step]
                    for t in range(hi, seg):
                        buf[out + t] = 0
                out += seg
            for t in range(cols, NR):
                buf[dst + t] = 0
            dst += NR
            j += 1
            if j == kw:
                j = 0
                i += 1
                if i == kh:
                    i = 0
                    c += 1
