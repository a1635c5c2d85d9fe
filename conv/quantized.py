"""The quantized convolution: the exact int8 GEMM on the input's pixels, one fused epilogue.

Per image and group the int32 sums ``acc (Ho*Wo x Kg)`` of the channels-last input
with the int8 weights (``kh*kw*Cg x Kg``, rows in (r, s, c) order), one of two ways:

* **taps** (every kernel but ``vnni``, and a ``Cg`` that fills whole words or one
  group): the input rows a block of pixels reads are widened once -- to int16 ``x -
  zero_point`` padded with 0 (``madd``, ``generic``), or to unsigned bytes padded
  with the zero point's (``maddubs``; the padding comes off through the weights'
  column sums) -- channels rounded up to whole words with zero channels
  (:func:`_widen`), and the taps kernel reads every tap's channels from them in
  place (``kernels/_int8.py`` ``qconv_taps``).  The patch matrix and its packing
  into int16 panels -- nine times the input for a 3x3, and the GEMM's largest cost
  when the layer has few output channels -- are not made: ResNet-18 conv2_x 3.0 ->
  1.9 ms on one Zen 3 core.
* **patches** (otherwise: ``vnni``, which reads its patch rows in place as words,
  and groups of channel counts that split words, such as depthwise layers): im2col, one byte per
  value, the padding filled with the input's zero point so that it adds nothing once
  the zero point is taken off, into :func:`tilegemm.kernels.qgemm.qgemm_into`; a
  1x1, stride-1 layer without padding reads the image in place.

The epilogue (:func:`finish`) takes the int32 sums to ``acc * x_scale * w_scale[k] +
bias[k]``, the activation, and then either float32 or a requantized code
``clip(round(y / out_scale) + out_zero_point)``, written straight into the output's
layout.
"""
import llvmlite.ir as ir
import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.ground.contracts import JIT, jit
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.workspace import buffers
from tilegemm.kernels.ir import data_ptr
from tilegemm.kernels.pool import run_shares
from tilegemm.kernels.int8 import GROUP, TILES
from tilegemm.kernels.qgemm import SHARE_OPS, qgemm_into, taps_into, widen_rows_into

#: Activation codes of :func:`finish`.
ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}


@intrinsic
def copy_bytes(typingctx, dst, dst_at, src, src_at, count):
    """``dst[dst_at:dst_at + count] = src[src_at:src_at + count]`` for 1-D byte arrays,
    as one ``llvm.memcpy``: Numba's slice copy and a plain loop over 64 bytes both ran
    as byte moves here (a 3x3 layer's patches took 1.4 ms, 0.15 ms as memcpy)."""
    def codegen(context, builder, sig, args):
        d, d_at, s, s_at, n = args
        cgutils.raw_memcpy(builder, data_ptr(context, builder, sig.args[0], d, d_at),
                           data_ptr(context, builder, sig.args[2], s, s_at), n, 1)
        return context.get_dummy_value()
    return types.void(dst, types.intp, src, types.intp, types.intp), codegen


@intrinsic
def fill_bytes(typingctx, dst, dst_at, value, count):
    """``dst[dst_at:dst_at + count] = value`` for a 1-D byte array, as one ``llvm.memset``."""
    def codegen(context, builder, sig, args):
        d, d_at, v, n = args
        byte = builder.trunc(v, ir.IntType(8))
        cgutils.memset(builder, data_ptr(context, builder, sig.args[0], d, d_at), n, byte)
        return context.get_dummy_value()
    return types.void(dst, types.intp, types.intp, types.intp), codegen


@jit
def patches_nhwc(x, n, c0, cg, geom, zero, p0, p1, out):
    """``out[pix - p0, (r*kw + s)*cg + c]`` for output pixels ``p0 <= pix < p1`` (pix =
    oy*Wo + ox): the input value under tap (r, s) of pixel (oy, ox) in channel
    ``c0 + c`` of image ``n``, ``zero`` in the padding.  Each tap's channels are a
    contiguous run of a row, copied from one input pixel (``x`` and ``out``
    C-contiguous, read as flat views); with every channel taken and no dilation along
    the row, a kernel row's taps are one run of the input (the stem's 3 channels: one
    copy of 21 bytes per kernel row instead of seven of 3)."""
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    C = x.shape[3]
    xf, of = x.reshape(-1), out.reshape(-1)
    depth = kh * kw * cg
    whole_rows = cg == C and dx == 1
    for pix in range(p0, p1):
        oy, ox = pix // Wo, pix % Wo
        ix0 = ox * sx - px
        for r in range(kh):
            iy = oy * sy - py + r * dy
            at = (pix - p0) * depth + r * kw * cg
            if not 0 <= iy < H:
                fill_bytes(of, at, zero, kw * cg)
            elif whole_rows:
                # taps [lo, hi) inside the row; a pad wider than the kernel can
                # leave none on either side
                lo = min(max(0, -ix0), kw)
                hi = max(min(kw, W - ix0), lo)
                fill_bytes(of, at, zero, lo * cg)
                copy_bytes(of, at + lo * cg, xf, ((n * H + iy) * W + ix0 + lo) * C,
                           (hi - lo) * cg)
                fill_bytes(of, at + hi * cg, zero, (kw - hi) * cg)
            else:
                for s in range(kw):
                    ix = ix0 + s * dx
                    if 0 <= ix < W:
                        copy_bytes(of, at + s * cg, xf, ((n * H + iy) * W + ix) * C + c0, cg)
                    else:
                        fill_bytes(of, at + s * cg, zero, cg)


@numba.njit(inline="always", **JIT)
def _epilogue(total, mult, bias, act, requant):
    """One output of :func:`finish`, as float64."""
    scale, zero_point, low, high = requant
    y = total * mult + bias
    if act > 0 and y < 0.0:
        y = 0.0
    if act == 2 and y > 6.0:
        y = 6.0
    if scale > 0.0:
        return min(max(np.rint(y / scale) + zero_point, low), high)
    return y


@jit
def finish(acc, mult, bias, act, requant, out):
    """``out = epilogue(acc)`` for ``acc`` and ``out`` pixels x channels: ``y = acc *
    mult[k] + bias[k]``, relu or relu6 (``act`` 1 or 2), then with ``requant =
    (scale, zero_point, low, high)`` and ``scale > 0`` the code ``clip(rint(y / scale)
    + zero_point, low, high)``, else y itself; in float64."""
    P, Kg = acc.shape
    for p in range(P):
        for k in range(Kg):
            out[p, k] = _epilogue(acc[p, k], mult[k], bias[k], act, requant)


def qconv2d_into(x, x_zero_point, weights, epilogue, p, out, panels=None, taps=None):
    """Run the quantized convolution of :class:`ConvParams` ``p`` into ``out``.

    ``x``: C-contiguous int8/uint8 input in ``p.layout``.  ``weights``: per group, the
    ``kh*kw*Cg x Kg`` int8 matrix (rows in (r, s, c) order, see
    :class:`tilegemm.QConvWeights`); None with ``taps``.  ``epilogue``: ``(mult, bias, act, requant)`` as
    :func:`finish` takes them, ``mult`` and ``bias`` float64 per output channel.
    ``out``: C-contiguous output (float32, int8, uint8 or int32) in ``p.layout``.
    ``panels``: per group, ``weights`` packed once (``kernels.qgemm.pack_b_once``), or None.
    ``taps``: per group, the weights with each tap's channels padded to whole words of
    the kernel, packed once: the sums come from the taps kernel (``kernels.qgemm.taps_serve``).

    Both layouts compute channels-last: an NCHW input is copied to NHWC first, or with
    ``taps`` its rows transposed as they are widened (a pixel's channels are then a
    contiguous run, and the GEMM has the pixels as its long side: 2x the rate of
    weights @ patches on ResNet-18 conv2_x),
    and an NCHW output is written through one transposing copy per block.  Threads
    take blocks of pixels (:func:`pixel_shares`), each its patches, product and
    epilogue, the weights' panels shared; or, with ``taps`` on an image whose
    weights outweigh its input, blocks of output channels (:func:`channel_shares`).
    """
    if p.layout == "NCHW" and taps is None:   # the taps kernel's rows are widened from NCHW
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    P = p.Ho * p.Wo
    ops = 2 * p.N * P * p.K * p.Cg * p.kh * p.kw
    threads = get_num_threads() if ops >= SHARE_OPS else 1
    block = (x, x.dtype.type(x_zero_point), weights, epilogue, p, out, (panels, taps))
    nr = None if taps is None else TILES[taps[0].kind][1]
    if taps is not None and p.N < threads <= -(-p.Kg // nr) and _weights_outweigh_input(p):
        shares = channel_shares(p.N, P, p.Kg, threads, nr)
    else:
        shares = [[(n, p0, p1, 0, p.Kg) for n, p0, p1 in part]
                  for part in pixel_shares(p.N, P, threads)]
    run_shares(lambda part: _pixels(block, part), [(part,) for part in shares])
    return out


def _weights_outweigh_input(p):
    """Whether a layer's int16 weights outnumber the values of its padded, widened
    input image: then threads that split the pixels would each stream all of them (ResNet-18
    conv4_x at batch 1: 1.2 MB of weights, 0.13 MB of input; two threads on pixel
    blocks ran 1.17-1.45x one, on output channels 1.61x).  Each thread then widens
    the whole image: cheap beside the weights it no longer streams."""
    return p.kh * p.kw * p.Cg * p.K > (p.top + p.H + p.bottom) * (p.left + p.W + p.right) * p.C


def pixel_shares(N, P, threads):
    """Per thread, its ``(image, first pixel, end pixel)`` blocks: whole images when
    there are at least as many as threads, else each image's pixels in equal runs."""
    if N >= threads:
        return [[(n, 0, P) for n in range(t, N, threads)] for t in range(threads)]
    parts = max(1, min(threads, P))
    cuts = [P * i // parts for i in range(parts + 1)]
    return [[(n, a, b) for n in range(N)] for a, b in zip(cuts, cuts[1:])]


def channel_shares(N, P, Kg, threads, unit):
    """Per thread, its ``(image, 0, P, first channel, end channel)`` blocks: every
    image's pixels for an equal run of each group's output channels, cut at
    multiples of ``unit`` (the kernel's NR) nearest an equal share."""
    parts = max(1, min(threads, -(-Kg // unit)))
    # each cut at the multiple of ``unit`` nearest an equal share
    cuts = [min(Kg, (2 * Kg * i + parts * unit) // (2 * parts * unit) * unit)
            for i in range(parts)] + [Kg]
    return [[(n, 0, P, a, b) for n in range(N)] for a, b in zip(cuts, cuts[1:]) if b > a]


def _pixels(block, part):
    """Blocks ``part`` of pixels and output channels (``(image, first pixel, end
    pixel, first channel, end channel)``, the channels of each group; only the taps
    kernel takes fewer than all) on this thread: per group, the sums of the weights
    with the patches (or, with the taps kernel, with the widened input read in place:
    :func:`_taps_sums`), then the epilogue."""
    x, zero, weights, (mult, bias, act, requant), p, out, (panels, taps) = block
    P = p.Ho * p.Wo
    rows_max = max((b - a for _, a, b, _, _ in part), default=0)
    depth = p.Cg * p.kh * p.kw
    acc, patches, rows = buffers(("qconv2d", x.dtype.str), (
        rows_max * p.Kg, 0 if taps else rows_max * depth, rows_max * p.Kg), np.int32)
    geom = p.geom()
    for n, p0, p1, j0, j1 in part:
        m = p1 - p0
        sums = acc[:m * p.Kg].reshape(m, p.Kg)
        # NCHW: the epilogue writes pixel-major rows here, then one transposing copy
        # (channel by channel, it read the sums a cache line per value: 2x slower).
        staged = rows.view(out.dtype)[:m * p.Kg].reshape(m, p.Kg)
        widened = _widen(x, n, zero, p, (p0, p1), taps[0].kind) if taps else None
        for g in range(p.groups):
            c0, k0 = g * p.Cg, g * p.Kg
            if taps:
                _taps_sums(widened, p, g, taps[g], sums, (p0, p1, j0, j1))
            else:
                if p.pointwise:        # the image is the patch matrix: read in place
                    a = x[n].reshape(P, p.C)[p0:p1, c0:c0 + p.Cg]
                else:
                    a = patches.view(x.dtype)[:m * depth].reshape(m, depth)
                    patches_nhwc(x, n, c0, p.Cg, geom, zero, p0, p1, a)
                qgemm_into(a, weights[g], sums, int(zero), 0,
                           None if panels is None else panels[g].kind, threads=1,
                           b_panels=None if panels is None else panels[g])
            ks = slice(k0 + j0, k0 + j1)
            scales = (mult[ks], bias[ks], act, requant)
            if p.layout == "NCHW":
                finish(sums[:, j0:j1], *scales, staged[:, j0:j1])
                out[n, ks].reshape(j1 - j0, P)[:, p0:p1] = staged[:, j0:j1].T
            else:
                finish(sums[:, j0:j1], *scales, out[n].reshape(P, p.K)[p0:p1, ks])


def _taps_geometry(p, pixels, group):
    """The padded input rows ``(r0, r1)`` the output pixels ``pixels`` read, the padded
    width and the 32-bit words of a widened pixel (``group`` channels a word, rounded
    up)."""
    oy0, oy1 = pixels[0] // p.Wo, (pixels[1] - 1) // p.Wo
    rows = (oy0 * p.sy, oy1 * p.sy + (p.kh - 1) * p.dy + 1)
    return rows, p.left + p.W + p.right, -(-p.C // group)


def _widen(x, n, zero, p, pixels, kind):
    """The input rows the pixels read, padded and widened for the int8 kernel ``kind``
    (one buffer per thread), as int32 words, and their padding value: the taps
    kernel's A (``kernels.qgemm.widen_rows_into``)."""
    group = GROUP[kind[0]]
    (r0, r1), Wp, Cw = _taps_geometry(p, pixels, group)
    words, = buffers(("qconv2d taps", x.dtype.str), ((r1 - r0) * Wp * Cw,), np.int32)
    pad = widen_rows_into(x, n, (p.top, p.left, Wp, group * Cw), zero, (r0, r1), words, kind,
                          p.layout)
    return words, pad


def _taps_sums(widened, p, g, panels, sums, part):
    """``sums`` = group ``g``'s int32 sums of the output pixels and channels ``part =
    (p0, p1, j0, j1)``, every tap read from the widened rows ``widened = (words, pad)``
    in place (``kernels.qgemm.taps_into``)."""
    group = GROUP[panels.kind[0]]
    (r0, _), Wp, Cw = _taps_geometry(p, part[:2], group)
    geom = (Wp, Cw, p.Wo, p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, r0)
    taps_into(widened[0], geom, (g * p.Cg // group, -(-p.Cg // group), p.Kg), panels,
              sums.reshape(-1), part[:2], part[2:], widened[1])
