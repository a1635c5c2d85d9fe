"""The quantized convolution: the exact int8 GEMM on the input's pixels, one fused epilogue.

Per image and group the int32 sums ``acc (Ho*Wo x Kg)`` of the channels-last input
with the int8 weights (``kh*kw*Cg x Kg``, rows in (r, s, c) order), one of two ways:

* **taps** (every vector kernel, and a ``Cg`` that fills whole words or one group):
  the input rows a block of pixels reads are widened once -- to int16 ``x -
  zero_point`` padded with 0 (``madd``, ``generic``), or to unsigned bytes padded
  with the zero point's (``vnni``, ``maddubs``; the padding comes off through the
  weights' column sums) -- channels rounded up to whole words with zero channels,
  and the taps kernel reads every tap's channels from them in place; one jitted call
  per thread (``kernels/_int8.py`` ``qconv_taps_blocks``, planned by
  :class:`TapsPlan`).  The patch matrix and its packing -- nine times the input for a
  3x3, and the GEMM's largest cost when the layer has few output channels -- are not
  made: ResNet-18 conv2_x 3.0 -> 1.9 ms on one Zen 3 core (``madd``); the quantized
  ResNet-18 14.2 -> 10.2 ms on an AVX-512 VNNI Xeon (``vnni``).
* **depthwise** (one channel per group): no GEMM; the sums accumulated tap by tap
  with lanes over the channels (:func:`qdepthwise_into`, ``kernels/qdepthwise.py``).
* **patches** (otherwise: groups of channel counts that split words): im2col, one
  byte per value, the padding filled with the input's
  zero point so that it adds nothing once the zero point is taken off, into
  :func:`tilegemm.kernels.qgemm.qgemm_into`; a 1x1, stride-1 layer without padding
  reads the image in place.

The epilogue (``kernels/requant.py``) takes the int32 sums to ``acc * x_scale *
w_scale[k] + bias[k]``, the activation, and then either float32 or a requantized code
``clip(round(y / out_scale) + out_zero_point)``, written straight into the output's
layout.
"""
import threading

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.ground.contracts import jit, round_up
from tilegemm.ground.entries import Entries
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.workspace import buffers, thread_buffers
from tilegemm.kernels.ir import data_ptr
from tilegemm.kernels.pool import NO_GATE, run_shares
from tilegemm.kernels.qdepthwise import qdepthwise_rows
from tilegemm.kernels.transpose import transpose_bytes
from tilegemm.kernels.int8 import GROUP, TILES
from tilegemm.kernels.int8_taps import amx_places, amx_rows, amx_rows_past
from tilegemm.kernels.qgemm import (SHARE_OPS, get_int8_kernel, int8_blocking, qgemm_into,
                                     widening)
from tilegemm.kernels.requant import ACTIVATIONS, finish_planes, finish_rows  # noqa: F401
from tilegemm.tuning.machine import detect


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


class TapsPanels:
    """A layer's weights for the taps kernel: every group's panels (``kh*kw*Cg x Kg``,
    each tap's channels padded to whole words, packed once by
    ``kernels.qgemm.pack_b_once``) in one array, so that one jitted call reads any
    group's (``kernels/_int8.py`` :func:`qconv_taps_blocks`).

    Parameters
    ----------
    packed : list of PackedB
        Per group, its panels (all of one shape and kernel).
    multiple, kw : int
        The panels' channels are a multiple of ``multiple`` and their kernel ``kw``
        wide (zero channels and zero taps added: ``kernels.qgemm.taps_kind_for``).
    """

    def __init__(self, packed, multiple, kw):
        self.kind, self.blocks = packed[0].kind, packed[0].blocks
        self.multiple, self.kw = multiple, kw
        self.starts = np.cumsum([0] + [b.words.size for b in packed]).astype(np.int64)
        self.words = np.concatenate([b.words for b in packed])
        self.col_sums = np.concatenate([b.col_sums for b in packed])
        self._cc = {}

    def corrections(self, pad):
        """Each output channel's column correction for widened rows padded with ``pad``:
        ``-pad`` times its sum of B, wrapping to int32 as the sums do (cached)."""
        cc = self._cc.get(pad)
        if cc is None:
            cc = self._cc[pad] = (-int(pad) * self.col_sums).astype(np.int32)
        return cc


def qconv2d_into(x, x_zero_point, weights, epilogue, p, out, panels=None, taps=None):
    """Run the quantized convolution of :class:`ConvParams` ``p`` into ``out``.

    ``x``: C-contiguous int8/uint8 input in ``p.layout``.  ``weights``: per group, the
    ``kh*kw*Cg x Kg`` int8 matrix (rows in (r, s, c) order, see
    :class:`tilegemm.QConvWeights`); None with ``taps``.  ``epilogue``: ``(mult, bias,
    act, requant, folded)`` as ``kernels/requant.py`` takes them, ``mult`` and ``bias``
    float64 per output channel.
    ``out``: C-contiguous output (float32, int8, uint8 or int32) in ``p.layout``.
    ``panels``: per group, ``weights`` packed once (``kernels.qgemm.pack_b_once``), or None.
    ``taps``: :class:`TapsPanels`: the sums come from the taps kernel
    (``kernels.qgemm.taps_serve``).

    Both layouts compute channels-last: an NCHW input is copied to NHWC first, or with
    ``taps`` its rows transposed as they are widened (a pixel's channels are then a
    contiguous run, and the GEMM has the pixels as its long side: 2x the rate of
    weights @ patches on ResNet-18 conv2_x),
    and an NCHW output is written from pixel-major sums.  Threads
    take blocks of pixels (:func:`pixel_shares`), each its patches, product and
    epilogue, the weights' panels shared; or, with ``taps`` on an image whose
    weights outweigh its input, blocks of output channels (:func:`channel_shares`).
    With ``taps`` this plans the call each time: :class:`TapsPlan` plans it once.
    """
    if taps is not None:
        return TapsPlan(p, x.dtype, x_zero_point, taps, epilogue, get_num_threads())(x, out)
    P = p.Ho * p.Wo
    threads = get_num_threads() if 2 * p.N * P * p.K * p.Cg * p.kh * p.kw >= SHARE_OPS else 1
    if p.layout == "NCHW":
        x = channels_last(x, p)
    block = (x, x.dtype.type(x_zero_point), weights, epilogue, p, out, panels)
    shares = [[(n, p0, p1) for n, p0, p1 in part] for part in pixel_shares(p.N, P, threads)]
    run_shares(lambda part: _pixels(block, part), [(part,) for part in shares])
    return out


def channels_last(x, p):
    """The C-contiguous NCHW int8/uint8 ``x`` of layer ``p`` copied to NHWC, in 16 x 16
    byte blocks (``kernels/transpose.py``; numpy's strided copy moves a byte at a time:
    an NCHW depthwise layer of 144 channels at 56 x 56, 719 -> 623 us a call)."""
    nhwc = np.empty((p.N, p.H, p.W, p.C), x.dtype)
    transpose_bytes(x.reshape(-1), nhwc.reshape(-1), (p.C, p.H * p.W), 0, p.N)
    return nhwc


def qdepthwise_into(x, zero, taps, epilogue, p, out):
    """A depthwise layer's quantized convolution (``p.Cg == p.Kg == 1``) into ``out``:
    ``taps`` the int32 weights as ``kernels/qdepthwise.py`` :func:`qdepthwise_rows`
    takes them; an NCHW input is copied to NHWC first.  Threads take whole images,
    or runs of output rows of one, each share one jitted call."""
    if p.layout == "NCHW":
        x = channels_last(x, p)
    ops = 2 * p.N * p.Ho * p.Wo * p.K * p.kh * p.kw
    threads = get_num_threads() if ops >= SHARE_OPS else 1
    geom = (p.Ho, p.Wo, p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, p.top, p.left, p.layout == "NCHW")
    shares = [np.array(rows, np.int64).reshape(-1, 3) for rows in pixel_shares(p.N, p.Ho, threads)]
    gate = NO_GATE if len(shares) == 1 else np.zeros(1, np.int64)
    # a row's sums, then a row of the zero point (bytes) for rows outside the image
    made = thread_buffers("qconv2d depthwise", len(shares), (p.Wo * p.K + -(-p.W * p.C // 4),),
                          np.int32)

    def share(t, blocks):
        qdepthwise_rows(x, np.int32(zero), taps, geom, blocks, epilogue, out, made[0][t], gate)
    if len(shares) == 1:
        share(0, shares[0])
    else:
        run_shares(share, list(enumerate(shares)), gate=gate)
    return out


def _weights_outweigh_input(p):
    """Whether a layer's weights outnumber twice the values of its padded, widened
    input image: then threads that split the pixels would each stream all of them (ResNet-18
    conv4_x at batch 1: 1.2 MB of weights, 0.13 MB of input; two threads on pixel
    blocks ran 1.17-1.45x one, on output channels 1.61x).  Each thread then widens
    the whole image: cheap beside the weights it no longer streams.  Twice, not once:
    a share of channels also finishes each pixel's codes (and a residual sum) in
    shorter runs, and on conv3_x (weights 1.3x the input) pixel shares made the
    quantized ResNet-18 on two threads 6.5-6.8 -> 6.0-6.2 ms (AVX-512 VNNI Xeon)."""
    return (p.kh * p.kw * p.Cg * p.K
            > 2 * (p.top + p.H + p.bottom) * (p.left + p.W + p.right) * p.C)


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
    """Blocks ``part`` of pixels (``(image, first pixel, end pixel)``) on this thread:
    per group, the sums of the weights with the patches, then the epilogue."""
    x, zero, weights, epilogue, p, out, panels = block
    P = p.Ho * p.Wo
    rows_max = max((b - a for _, a, b in part), default=0)
    depth = p.Cg * p.kh * p.kw
    acc, patches = buffers(("qconv2d", x.dtype.str), (rows_max * p.Kg, rows_max * depth),
                           np.int32)
    geom = p.geom()
    flat = out.reshape(-1)
    for n, p0, p1 in part:
        m = p1 - p0
        sums = acc[:m * p.Kg].reshape(m, p.Kg)
        for g in range(p.groups):
            c0, k0 = g * p.Cg, g * p.Kg
            if p.pointwise:        # the image is the patch matrix: read in place
                a = x[n].reshape(P, p.C)[p0:p1, c0:c0 + p.Cg]
            else:
                a = patches.view(x.dtype)[:m * depth].reshape(m, depth)
                patches_nhwc(x, n, c0, p.Cg, geom, zero, p0, p1, a)
            qgemm_into(a, weights[g], sums, int(zero), 0,
                       None if panels is None else panels[g].kind, threads=1,
                       b_panels=None if panels is None else panels[g])
            if p.layout == "NCHW":
                finish_planes(acc, p.Kg, epilogue, k0, flat, (n * p.K + k0) * P + p0, P,
                              (m, p.Kg))
            else:
                finish_rows(acc, 0, p.Kg, epilogue, k0, flat, (n * P + p0) * p.K + k0, p.K,
                            (m, p.Kg))


class TapsPlan:
    """A quantized convolution on the taps kernel, planned once for one layer and a
    thread count: every argument of the jitted driver (``kernels/_int8.py``
    :func:`qconv_taps_blocks`) but the input, the output and the scratch, so that
    a call spends no Python on them (on a 2-core VM each line of Python after a
    millisecond of kernel ran cold: 0.1-0.3 ms a call had gone to building them).

    The input rows of each block are widened once, to int16 ``x - zero`` padded
    with 0 for the pair kinds or to unsigned bytes padded with the zero point's byte
    for the byte kinds (the padding then comes off through the weights' column
    sums); its pixels then go in chunks whose sums stay in L2 until the epilogue
    reads them.

    Parameters
    ----------
    p : ConvParams
    x_dtype : numpy.int8 or numpy.uint8
    zero : int
        The input's zero point.
    taps : TapsPanels
    epilogue : tuple
        ``(mult, bias, act, requant, folded)`` as ``kernels/requant.py`` takes them.
    threads : int
    summed : tuple, optional
        A residual sum after the conv (NHWC only): ``(scales, zeros, relu, low, high,
        conv_first, codes dtype)``, the quantization as
        :func:`~tilegemm.kernels.requant.add_codes` takes it, whether the conv's codes
        are the sum's first operand, and their dtype; calls then take the residual.
    """

    def __init__(self, p, x_dtype, zero, taps, epilogue, threads, summed=None):
        kind, bits = taps.kind
        self.mod = get_int8_kernel(kind, bits)
        self._run = Entries(self.mod.qconv_taps_blocks)
        group = GROUP[kind]
        Wp, Cw = p.left + p.W + p.right, round_up(p.C, taps.multiple) // group
        kw = taps.kw         # amx: the kernel's width made up with zero taps
        if kw != p.kw and kind != "amx":
            raise ValueError("TapsPlan: zero taps are read by amx tiles only")
        self.widening, self.wide = widening(kind, x_dtype, zero)
        # rows that widening would copy unchanged are read in place (a 1x1 layer's
        # uint8 NHWC input: ResNet-50's 256 x 56 x 56 is 0.8 MB a call); amx tiles,
        # which read past the last pixel, read the last rows widened, or in place
        # from a buffer with ``room`` bytes more after the input
        self.in_place = (self.wide == np.uint8 and self.widening[0] == 0 and p.layout == "NHWC"
                         and p.C == Cw * group and p.top == p.left == p.bottom == p.right == 0)
        past = amx_rows_past(Wp, p.Wo, (kw, p.dx), (p.sy, p.sx)) if kind == "amx" else 0
        self.room = 0 if not self.in_place else \
            max(0, (p.Ho - 1) * p.sy + (p.kh - 1) * p.dy + 1 + past - p.H) * Wp * p.C
        self.conv = (p.Wo, p.kh, kw, p.sy, p.sx, p.dy, p.dx, p.top, p.left, Wp, Cw,
                     p.layout == "NCHW")
        KC, NC = taps.blocks
        MC = int8_blocking(kind, bits)[1]
        self.weights = (taps.words, taps.starts, p.Cg // group if p.groups > 1 else Cw,
                        taps.corrections(self.widening[1]), (KC, MC, NC))
        self.epilogue = epilogue
        # the tiles write an NHWC output's codes from their registers where the
        # epilogue is folded into float32 (its sums then never go to memory)
        self.codes = p.layout == "NHWC" and epilogue[4][0].size > 0
        if summed is not None and p.layout != "NHWC":
            raise ValueError("TapsPlan: a residual sum needs the NHWC layout")
        self.summed = summed
        # the arguments every call passes as they are
        self._fixed = (self.conv, self.widening, self.weights, self.epilogue)
        self._no_sum = (_NO_CODES,) + _NO_SUM
        self.blocks = [np.array(part, np.int64).reshape(-1, 5)
                       for part in _taps_shares(p, threads, TILES[taps.kind][1])]
        rows = max(int((b[:, 2] - b[:, 1]).max()) for b in self.blocks)
        # the sums of a chunk of pixels in a quarter of L2, whole MC blocks of them
        self.chunk = min(rows, max(1, detect().l2_bytes // 16 // (p.Kg * MC)) * MC)
        span = max(int(((b[:, 2] - 1) // p.Wo - b[:, 1] // p.Wo).max()) for b in self.blocks)
        in_rows = span * p.sy + (p.kh - 1) * p.dy + 1
        places = self.chunk
        if kind == "amx":    # its tiles' places, and rows for the pixels past the last
            Wv = amx_rows(Wp, p.Wo, p.sy, p.sx)
            places = max(places, amx_places(self.chunk, p.Wo, Wv))
            in_rows += amx_rows_past(Wp, p.Wo, (kw, p.dx), (p.sy, p.sx))
        intp_words = np.dtype(np.intp).itemsize // 4
        # with a residual sum, a chunk's codes wait in a buffer of their own
        self.sizes = (in_rows * Wp * Cw, self.chunk * p.Kg, self.mod.MR,
                      intp_words * (2 * (p.kh * kw + 1) + places),
                      0 if summed is None else -(-self.chunk * p.K // 4))
        self._local = threading.local()

    def __call__(self, x, out, residual=None, held=None):
        """The convolution of the C-contiguous ``x`` into ``out`` (C-contiguous); with
        a residual sum (``summed``), ``out`` is its sum with ``residual``'s codes
        (C-contiguous, ``out``'s shape).  ``held``: a 1-D byte array that starts with
        ``x``'s bytes and has at least :attr:`room` bytes after them, where amx tiles
        may read every pixel's rows in place."""
        made = thread_buffers("qconv2d taps", len(self.blocks), self.sizes, np.int32)
        local = self._local
        if getattr(local, "made", None) is not made:
            local.calls = [(blocks, self._scratch(made, t)) for t, blocks in enumerate(self.blocks)]
            local.made = made
        x_words = _NO_WORDS if not self.in_place else \
            x.reshape(-1).view(np.int32) if held is None else held.view(np.int32)
        if self.summed is None and len(local.calls) == 1:       # the common case, at once
            blocks, scratch = local.calls[0]
            flat = out.reshape(-1)
            # the types the entry point was found for: the arrays' dtypes, dimensions
            # and flags (x and out C-contiguous: PreparedQConv's calls make them so;
            # every other argument's type is fixed by the plan)
            xf, wf, of = x.flags, x_words.flags, out.flags
            self._run((x.dtype.num, x.ndim, xf.writeable, wf.writeable, wf.aligned,
                       out.dtype.num, out.ndim, of.aligned, of.writeable, of.c_contiguous),
                      x, x_words, blocks, *self._fixed, out, self.epilogue[4], self._no_sum,
                      scratch[:-1] + (flat, flat if self.codes else _NO_CODES), NO_GATE)
            return out
        if self.summed is None:
            summed, dest = self._no_sum, out.reshape(-1)
        else:
            summed, dest = (residual.reshape(-1),) + self.summed[:-1], None
        run, args = self.mod.qconv_taps_blocks, self._fixed + (out, self.epilogue[4], summed)
        gate = NO_GATE if len(local.calls) == 1 else np.zeros(1, np.int64)

        def share(blocks, scratch):
            mid = scratch[-1].view(self.summed[-1]) if dest is None else dest
            run(x, x_words, blocks, *args, scratch[:-1] + (mid, mid if self.codes else _NO_CODES),
                gate)
        if len(local.calls) == 1:
            share(*local.calls[0])
        else:
            # The caller starts its own share once a worker's has let go of the GIL: a
            # worker waiting for it sleeps (tens of microseconds to wake on a VM).
            run_shares(share, local.calls, gate=gate)
        return out

    def _scratch(self, made, t):
        """Share ``t``'s scratch (as :func:`qconv_taps_blocks` takes it, the codes'
        buffer last) in ``made``."""
        words, acc, zeros, offsets, mid = (buf[t] for buf in made)
        zeros[:] = 0
        return (words, words.view(self.wide), acc, zeros, offsets.view(np.intp), self.chunk, mid)


_NO_WORDS = np.zeros(0, np.int32)
_NO_CODES = np.zeros(0, np.uint8)
#: ``summed``'s quantization when there is no residual.
_NO_SUM = (np.ones(3, np.float32), np.zeros(3, np.int64), False, np.float32(0), np.float32(0),
           True)


def _taps_shares(p, threads, nr):
    """Per thread, its blocks ``(image, p0, p1, j0, j1)`` of output pixels and each
    group's output channels: runs of channels cut at multiples of the kernel's ``nr``
    (:func:`channel_shares`) where the weights outweigh the input, else
    :func:`pixel_shares`; one thread below ``SHARE_OPS`` operations."""
    P = p.Ho * p.Wo
    if 2 * p.N * P * p.K * p.Cg * p.kh * p.kw < SHARE_OPS:
        threads = 1
    if p.N < threads <= -(-p.Kg // nr) and _weights_outweigh_input(p):
        return channel_shares(p.N, P, p.Kg, threads, nr)
    return [[(n, p0, p1, 0, p.Kg) for n, p0, p1 in part] for part in pixel_shares(p.N, P, threads)]
