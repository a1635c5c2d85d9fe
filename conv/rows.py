"""The rows path: A's rows (one output pixel's channels under one tap) read in place.

Serves every NHWC layer, and NCHW layers of one group (:func:`serves`).  The
planner takes it for NHWC layers the planes path does not win, and for NCHW layers
where :func:`nchw_applies` finds its register tiles (pixels x output channels)
fuller than the taps kernel's (output channels x an image's pixels).

Cost: the GEMM over the whole batch's pixels, KC channels per tap (``kw*C`` where
a kernel row is one run, :func:`rows_merged`), no copy of the image; NCHW writes C
through a transposing copy.  The drivers are ``conv/_tile_rows.py``.
"""
import collections
import functools

import numpy as np

from tilegemm.conv import engine
from tilegemm.ground.contracts import EPI_BIAS_COL, cdiv, round_up
from tilegemm.tuning.machine import detect

#: Share of L1d the input pixels of one tile (its row panel, every tap, KC channels)
#: may take: KC is as large as that allows, each call then sums that many k steps
#: per tap (docs/conv-paths.md).
ROWS_A_L1 = 0.5
#: Share of L2 a block of packed weights (``ntaps x KC`` rows, NC columns) may take:
#: it is read again for every row panel of pixels.
ROWS_B_L2 = 0.5
#: Share of L2 the input pixels a task reads for one KC block may take (its tiles
#: come back to them for every NC block and for the taps of the next rows).
ROWS_A_L2 = 0.25
#: Tasks per thread the pixels are cut into, at least, where they are many.
ROWS_TASKS_PER_THREAD = 4


def pack_weights(w, p, KC, NR):
    """Weights for :func:`rows_nhwc_task`: group ``g`` from ``g*Cg*ntaps*Np``, then per KC
    block of channels (``pc*ntaps*Np`` on) NR-column panels of ``ntaps*kc*NR`` values,
    tap ``t``'s ``kc x NR`` panel (k-major) at ``t*kc*NR``.  Array copies, one per
    channel block, all groups at once."""
    ntaps = p.kh * p.kw
    Np = round_up(p.Kg, NR)
    buf = np.zeros(p.groups * p.Cg * ntaps * Np + 1, w.dtype)
    per_group = buf[:-1].reshape(p.groups, p.Cg * ntaps * Np)
    wg = np.zeros((p.groups, Np, p.Cg, ntaps), w.dtype)
    wg[:, :p.Kg] = w.reshape(p.groups, p.Kg, p.Cg, ntaps)
    for pc in range(0, p.Cg, KC):
        kc = min(KC, p.Cg - pc)
        block = wg[:, :, pc:pc + kc].reshape(p.groups, Np // NR, NR, kc, ntaps)
        per_group[:, pc * ntaps * Np:(pc + kc) * ntaps * Np] = (
            block.transpose(0, 1, 4, 3, 2).reshape(p.groups, -1))
    return buf, Np


RowsPlan = collections.namedtuple("RowsPlan", "KC NC MP m KS parts ntasks threads merged offs "
                                              "zeros cbuf numbers")


#: NCHW layers run on the rows kernel only with this many input channels (a group) ...
ROWS_NCHW_MIN_CHANNELS = 48
#: ... and output planes of at most this many pixels.
ROWS_NCHW_MAX_PLANE = 4096


def nchw_applies(p, dtype=np.float32, target=None):
    """Whether an NCHW layer runs on the rows kernel (:func:`run`) rather than the
    taps kernel (:func:`tilegemm.conv.taps.run`): one group, not 1x1 stride 1, at least
    ``ROWS_NCHW_MIN_CHANNELS`` channels, an output plane of at most
    ``ROWS_NCHW_MAX_PLANE`` pixels, and register tiles at least as full.

    The rows kernel's vectors run along the output channels (its tiles are ``MR``
    pixels of the whole batch by ``NR`` channels), the taps kernel's along an
    image's output plane (``MR`` channels by ``NR`` pixels): small planes leave the
    taps kernel's lanes empty (ResNet-18 conv5_x, 49 pixels, 64 lanes), output
    channels short of ``NR`` the rows kernel's; large planes cost the rows kernel
    a page per channel a tile reads, and its C goes through a transposing copy.
    Measurements: docs/conv-paths.md.
    """
    if p.layout != "NCHW" or p.groups != 1 or p.pointwise:
        return False
    if p.Cg < ROWS_NCHW_MIN_CHANNELS or p.Ho * p.Wo > ROWS_NCHW_MAX_PLANE:
        return False
    target = engine.host_target(dtype) if target is None else target
    mr, nr = target.mr, target.nr
    pixels, plane = p.N * p.Ho * p.Wo, p.Ho * p.Wo
    rows_fill = p.Kg / round_up(p.Kg, nr) * pixels / round_up(pixels, mr)
    taps_fill = p.Kg / round_up(p.Kg, mr) * plane / round_up(plane, nr)
    return rows_fill >= taps_fill


def rows_kc(p, itemsize, MR, l1_bytes, a_l1=None):
    """KC of :func:`run`: channels per block, so that the input pixels a tile
    reads (kh rows of its MR pixels' receptive field) take ``a_l1`` of L1d.

    NHWC packs a pixel's channels together; NCHW spends a row's cache lines (and
    one more, for their alignment) on each channel.
    """
    a_l1 = ROWS_A_L1 if a_l1 is None else a_l1
    span = field_span(p, MR)
    if p.layout == "NCHW":
        per_channel = p.kh * (cdiv(span * itemsize, 64) + 1) * 64
    else:
        per_channel = p.kh * span * itemsize
    return engine.balanced_kc(p.Cg, max(1, int(l1_bytes * a_l1) // per_channel))


def rows_run(p, itemsize, MR, KC, l1_bytes, a_l1=None):
    """Row panels of pixels one call of the panels kernel runs against one NR panel of
    weights (NHWC): as many as keep their input pixels (every tap, ``KC`` channels)
    in the share of L1d that :func:`rows_kc` gives one panel, so they are read from
    L1 again for the next NR panel.  A layer of few channels runs many panels per
    call; one whose KC that share limits, one."""
    a_l1 = ROWS_A_L1 if a_l1 is None else a_l1
    return max(1, int(l1_bytes * a_l1) // (p.kh * field_span(p, MR) * KC * itemsize))


def field_span(p, MR):
    """Input pixels in one row of the receptive field of ``MR`` adjacent output pixels."""
    return (MR - 1) * p.sx + (p.kw - 1) * p.dx + 1


def rows_merged(p, KC):
    """Whether :func:`run` may read a kernel row's taps as one run of kw*C values."""
    return p.layout == "NHWC" and p.groups == 1 and KC >= p.Cg and p.dx == 1 and p.kw > 1


@functools.lru_cache(maxsize=256)
def rows_plan(p, itemsize, threads, MR, NR, l1_bytes, l2_bytes, a_l1, b_l2, a_l2,
               tasks_per_thread):
    """Blocking and task split of :func:`run`, once per layer shape."""
    ntaps = p.kh * p.kw
    KC = rows_kc(p, itemsize, MR, l1_bytes, a_l1)
    Np = round_up(p.Kg, NR)
    NC = max(NR, int(l2_bytes * b_l2) // (ntaps * KC * itemsize) // NR * NR)
    NC = round_up(cdiv(Np, cdiv(Np, NC)), NR)                # equal blocks
    m = p.N * p.Ho * p.Wo
    # Pixels per task: their input rows for one KC block in a share of L2 (about
    # kh*sy rows of input per row of output), and in NCHW their C tile too, but
    # enough tasks for every thread.
    per_pixel = KC * itemsize * p.kh * p.sy + (Np * itemsize if p.layout == "NCHW" else 0)
    blocks = cdiv(m, max(MR, int(l2_bytes * a_l2) // per_pixel // MR * MR))
    parts = 1
    if threads > 1:
        want = threads * tasks_per_thread
        # Every block of pixels streams all the weights it multiplies: where they
        # outweigh the image, the tasks also split the output channels.
        weights = p.groups * ntaps * p.Cg * Np * itemsize
        if weights > p.N * p.H * p.W * p.C * itemsize:
            parts = max(1, min(Np // NR, cdiv(want, blocks)))
        blocks = max(blocks, cdiv(want, parts))
    MP = min(round_up(cdiv(m, blocks), MR), round_up(m, MR))
    KS = round_up(cdiv(Np, parts), NR)                   # output channels a task
    parts = cdiv(Np, KS)
    # Few tasks come in a multiple of the threads, so that the threads end together.
    while threads > 1 and MP > MR and cdiv(m, MP) * parts % threads \
            and cdiv(m, MP) * parts < 32 * threads:
        MP -= MR
    ntasks = cdiv(m, MP) * parts
    merged = rows_merged(p, KC)
    QB = rows_run(p, itemsize, MR, KC, l1_bytes, a_l1)
    offs = MP // MR * (ntaps * MR + 1)                  # see panel_stride
    if p.layout == "NCHW":
        zeros = (KC - 1) * p.H * p.W + 1            # read KC values H*W apart
        cbuf = MP * Np
    else:
        zeros = p.kw * p.Cg if merged else KC
        cbuf = 1
    numbers = engine.record(ntasks=ntasks, KC=KC, NC=NC, MP=MP, m=m, KS=KS, parts=parts,
                            merged=merged, QB=QB, C=p.C, Cg=p.Cg, G=p.groups, K=p.K, Kg=p.Kg,
                            Np=Np, p=p)
    return RowsPlan(KC, NC, MP, m, KS, parts, ntasks, max(1, min(threads, ntasks)), merged, offs,
                    zeros, cbuf, numbers)


@functools.lru_cache(maxsize=16)
def zero_row(size, dtype):
    """``size`` zeros of ``dtype``, shared by every call: the rows kernel's padding row,
    read and never written (NCHW's is ``(KC-1)*H*W + 1`` long)."""
    return np.zeros(size, dtype)


def run(x, w, bias, out, p, act, accumulate=False):
    """Convolution on the rows kernel: no patches, the image read where it lies.

    NHWC, any groups: C is the output itself, and ``accumulate`` adds the
    convolution to what it holds (beta = 1: a residual summed in the epilogue).
    NCHW, one group: each task's C goes through a per-thread buffer, transposed into
    the output's planes.
    """
    return bind(w, bias, p, out.dtype)(x, out, act, accumulate)


def bind(w, bias, p, dtype):
    """:func:`run` for the layer ``p`` with these weights and bias, as
    ``run(x, out, act, accumulate=False)``: the kernel, the bias and, per thread
    count, the plan and zero row are settled once (a layer called again and again
    pays only the launch).  The packed weights come from the engine's cache on each
    call, which compares plain weight arrays with what was packed."""
    dtype = np.dtype(dtype)
    kernel = engine.filling_kernel(dtype, p.Kg)
    mod = engine.template_module("rows", dtype, kernel.mr, kernel.nr, kernel.isa)
    MR, NR = kernel.mr, kernel.nr
    machine = detect()
    b = np.zeros(1, dtype) if bias is None else np.ascontiguousarray(bias, dtype)
    has_bias = EPI_BIAS_COL if bias is not None else 0
    plans = {}

    def setup(threads):
        plan = rows_plan(p, dtype.itemsize, threads, MR, NR, machine.l1d_bytes,
                         machine.l2_bytes, ROWS_A_L1, ROWS_B_L2, ROWS_A_L2,
                         ROWS_TASKS_PER_THREAD)
        return plan, zero_row(plan.zeros, dtype.str)

    def run_bound(x, out, act, accumulate=False):
        if accumulate and p.layout != "NHWC":
            raise ValueError("the rows path accumulates into NHWC outputs only")
        threads = engine.threads_for(p.flops, 1 << 30)
        plan, zeros = plans.get(threads) or plans.setdefault(threads, setup(threads))
        bpack, _ = engine.prepared("im2col_rows", w, (plan.KC, NR),
                                   lambda w: pack_weights(w, p, plan.KC, NR))
        epi = act | has_bias
        (offs,) = engine.thread_buffers(("im2col_rows", kernel.name), plan.threads,
                                        (plan.offs,), np.intp)
        x1, out1 = x.reshape(-1), out.reshape(-1)
        if p.layout == "NCHW":
            (cbufs,) = engine.thread_buffers(("im2col_rows_c", kernel.name), plan.threads,
                                             (plan.cbuf,), dtype)
            engine.launch_tasks(mod.rows_nchw_tasks, lambda t: (
                plan.numbers, x1, bpack, b, epi, out1, zeros, (offs[t], cbufs[t])),
                plan.threads)
            return out
        beta0 = 1.0 if accumulate else 0.0
        engine.launch_tasks(mod.rows_nhwc_tasks, lambda t: (
            plan.numbers, x1, bpack, b, epi, out1, zeros, offs[t], beta0), plan.threads)
        return out
    return run_bound


def serves(p):
    """Whether the path computes ``p``: NHWC, or NCHW with one group."""
    return p.layout == "NHWC" or p.groups == 1
