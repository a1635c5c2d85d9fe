"""Convolution as GEMM through implicit im2col, and 1x1 convolutions as plain GEMMs.

NCHW, per image and group: ``out[K, Ho*Wo] = W[K, C*kh*kw] @ col`` -- the weights
are packed A (once, cached), the patch matrix is packed B straight from the image
(:func:`tilegemm.packing.im2col.pack_b_im2col`), the bias is per row.

NHWC, over the whole batch: ``out[N*Ho*Wo, K] = col^T @ W^T`` -- the weights are
packed B, and A's rows (one output pixel's channels under one tap) are read where
they lie in the image (:func:`_run_rows`); the bias is per column.

A 1x1 stride-1 unpadded convolution needs no patches at all: the image itself,
viewed as (C, H*W) in NCHW or (N*H*W, C) in NHWC, is the GEMM operand.
"""
import collections
import dataclasses
import functools

import numpy as np

from tilegemm.conv import engine
from tilegemm.conv.params import FLAT, PADDED, PHASED
from tilegemm.kernels.driver import gemm_into
from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_BIAS_ROW
from tilegemm.packing import pack_a
from tilegemm.tuning.machine import detect, l1_alias_period


def _pack_weights_a(w2, KC, MR):
    """Pack ``w2`` (M x ckk) as A for every KC block: block ``pc`` at ``pc*Mp``."""
    M, ckk = w2.shape
    Mp = engine.round_up(M, MR)
    buf = np.zeros(Mp * ckk + 1, w2.dtype)
    flat = np.ascontiguousarray(w2).reshape(-1)
    for pc in range(0, ckk, KC):
        kc = min(KC, ckk - pc)
        pack_a(flat, pc, ckk, 1, M, kc, MR, buf[pc * Mp:])
    return buf, Mp


def _bias_slices(bias, p, dtype, length=None):
    """Per-group contiguous bias (or a one-element dummy) and whether it is used.

    ``length`` pads each slice with zeros (for kernels that read a whole row panel).
    """
    if bias is None:
        dummy = np.zeros(1, dtype)
        return [dummy] * p.groups, False
    out = []
    for g in range(p.groups):
        b = np.zeros(max(length or p.Kg, p.Kg), dtype)
        b[:p.Kg] = bias[g * p.Kg:(g + 1) * p.Kg]
        out.append(b)
    return out, True


def pointwise(x, w, bias, out, p, act):
    """1x1 stride-1 convolution: the image is the GEMM operand.

    NCHW goes through the implicit-im2col driver, whose packer is the GEMM's B packer
    here (the image viewed as (C, H*W)) and whose prepared weights and full-tile row
    panels beat a general GEMM call per image; NHWC is one GEMM per group over the
    whole batch.
    """
    if p.layout == "NCHW":
        return _run_nchw(x, w, bias, out, p, act)
    biases, has_bias = _bias_slices(bias, p, out.dtype)
    epi = act | (EPI_BIAS_COL if has_bias else 0)
    for g in range(p.groups):
        c = slice(g * p.Cg, (g + 1) * p.Cg)
        k = slice(g * p.Kg, (g + 1) * p.Kg)
        w2 = w[k, :, 0, 0]                                   # (Kg, Cg)
        gemm_into(x.reshape(-1, p.C)[:, c], w2.T, out.reshape(-1, p.K)[:, k],
                  bias=biases[g], epi=epi)
    return out


def run(x, w, bias, out, p, act, path=None):
    """Implicit-im2col convolution into ``out`` (C-contiguous, layout ``p.layout``).

    ``x`` is C-contiguous in ``p.layout``, ``w`` is (K, C/groups, kh, kw) contiguous,
    ``act`` the activation's epilogue flags.  ``path`` (one of :data:`PATHS`, and
    one that :func:`serves` ``p``) overrides :func:`route`'s choice.
    """
    if path is None:
        path = route(p, out.dtype)
    run_path = {ROWS: _run_rows, SHIFTED: _run_shifted, PLANES: _run_planes,
                PACKED: _run_nchw}[path]
    return run_path(x, w, bias, out, p, act)


#: The paths of :func:`run`: the rows kernel (A's rows read in place), the taps kernel
#: (B read in place or from a stride-split copy), the taps kernel over NHWC groups
#: copied as planes, and B panels packed from the image.
ROWS, SHIFTED, PLANES, PACKED = "rows", "shifted", "planes", "packed"
PATHS = (ROWS, SHIFTED, PLANES, PACKED)


def route(p, dtype=np.float32, target=None):
    """Which path :func:`run` takes for ``p`` (1x1 stride-1 layers aside, which
    :func:`pointwise` serves): ``ROWS``, ``SHIFTED``, ``PLANES`` or ``PACKED``.

    ``target`` (:data:`tilegemm.conv.engine.Target`) defaults to the host's."""
    target = engine.host_target(dtype) if target is None else target
    if p.layout == "NCHW":
        if rows_nchw_ok(p, dtype, target):
            return ROWS
        return SHIFTED if shifted_ok(p, dtype) else PACKED
    return PLANES if planes_ok(p, dtype, target) else ROWS


def serves(path, p, dtype=np.float32):
    """Whether ``path`` computes ``p`` correctly (whatever its speed): the paths a
    caller may force.  Independent of the machine."""
    if path == PACKED:
        return p.layout == "NCHW"
    if path == SHIFTED:
        return shifted_ok(p, dtype)
    if path == ROWS:
        return p.layout == "NHWC" or p.groups == 1
    if path == PLANES:
        return _planes_fit(p, dtype)
    return False


def _run_nchw(x, w, bias, out, p, act):
    kernel, blk = engine.plan(out.dtype)
    mod = engine.family_module("im2col", out.dtype)
    MR, NR = kernel.mr, kernel.nr
    plan = _nchw_plan(p, out.dtype.str, engine.threads_for(p.flops // p.groups, 1 << 30), MR, NR,
                      blk.kc, blk.mc, blk.nc, TASKS_PER_THREAD, IM2COL_PART_COLUMNS)
    ckk, KC = plan.ckk, plan.KC

    def build(w):
        return [_pack_weights_a(w[g * p.Kg:(g + 1) * p.Kg].reshape(p.Kg, ckk), KC, MR)
                for g in range(p.groups)]

    packed = engine.prepared("im2col_nchw", w, (p.groups, KC, MR), build)
    biases, has_bias = _bias_slices(bias, p, out.dtype, plan.Mp)
    epi = act | (EPI_BIAS_ROW if has_bias else 0)
    xf, of = x.reshape(-1), out.reshape(-1)
    bpacks, tiles, edges = engine.thread_buffers(("im2col_nchw", kernel.name), plan.threads,
                                                 plan.sizes, out.dtype)
    for g in range(p.groups):
        apack, Mp = packed[g]
        args = (plan.ntasks, xf, g * p.Cg * plan.xs[1], plan.xs, plan.geom, ckk, apack, Mp, p.Kg,
                plan.msplit, plan.mstep, plan.n_jc, of, g * p.Kg * plan.os[1], plan.os,
                biases[g], epi, KC, blk.mc, plan.NC)
        engine.launch(lambda t, counter: mod.im2col_nchw_tasks(counter, *args, bpacks[t], tiles[t],
                                                            edges[t]),
                      plan.threads)
    return out


NchwPlan = collections.namedtuple("NchwPlan", "ckk KC Mp NC n_jc msplit mstep ntasks threads "
                                              "sizes xs os geom")


@functools.lru_cache(maxsize=256)
def _nchw_plan(p, dtype, threads, MR, NR, kc, mc, nc, tasks_per_thread, part_columns):
    """What :func:`_run_nchw` derives from the geometry alone, once per layer shape.

    ``threads`` is the most the call may use (one launch per group), ``kc``, ``mc``
    and ``nc`` the GEMM blocking; the tuning constants are arguments so that
    changing them takes effect.
    """
    ckk = p.Cg * p.kh * p.kw
    pixels = p.Ho * p.Wo
    KC = engine.balanced_kc(ckk, kc)
    Mp = engine.round_up(p.Kg, MR)
    # Balance the pixel blocks: NC no larger than the blocking's, as equal as possible.
    n_jc = -(-pixels // nc)
    if threads > 1:
        # Finer pixel blocks for enough tasks to balance the threads (see
        # TASKS_PER_THREAD), none under IM2COL_PART_COLUMNS: each task streams all of A.
        n_jc = max(n_jc, min(-(-tasks_per_thread * threads // p.N), pixels // part_columns))
    NC = engine.round_up(-(-pixels // n_jc), NR)
    n_jc = -(-pixels // NC)
    # With few (image, pixel block) pairs, split the output channels too so every thread works.
    msplit = 1
    if p.N * n_jc < threads:
        msplit = min(-(-threads // (p.N * n_jc)), -(-p.Kg // MR))
    mstep = engine.round_up(-(-p.Kg // msplit), MR)
    msplit = -(-p.Kg // mstep)
    ntasks = p.N * n_jc * msplit
    sizes = (KC * engine.round_up(NC, NR), MR * NR, MR * engine.round_up(NC, NR))
    return NchwPlan(ckk, KC, Mp, NC, n_jc, msplit, mstep, ntasks,
                    max(1, min(threads, ntasks)), sizes, p.input_strides(), p.output_strides(),
                    p.geom())


# --- NHWC without patch panels: A's rows read in place, one offset per pixel and tap ------

#: Share of L1d the input pixels of one tile (its row panel, every tap, KC channels)
#: may take: KC is as large as that allows, each call then sums that many k steps
#: per tap (ResNet-18 conv4_x, 1 thread: 26 channels 82 GFLOPS, 128 channels 87).
ROWS_A_L1 = 0.5
#: Share of L2 a block of packed weights (``ntaps x KC`` rows, NC columns) may take:
#: it is read again for every row panel of pixels.
ROWS_B_L2 = 0.5
#: Share of L2 the input pixels a task reads for one KC block may take (its tiles
#: come back to them for every NC block and for the taps of the next rows).
ROWS_A_L2 = 0.25
#: Tasks per thread the pixels are cut into, at least, where they are many.
ROWS_TASKS_PER_THREAD = 4


def _pack_weights_rows(w, p, KC, NR):
    """Weights for :func:`rows_nhwc_task`: group ``g`` from ``g*Cg*ntaps*Np``, then per KC
    block of channels (``pc*ntaps*Np`` on) NR-column panels of ``ntaps*kc*NR`` values,
    tap ``t``'s ``kc x NR`` panel (k-major) at ``t*kc*NR``.  Array copies, one per
    channel block, all groups at once."""
    ntaps = p.kh * p.kw
    Np = engine.round_up(p.Kg, NR)
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
                                              "zeros cbuf")


#: NCHW layers run on the rows kernel only with this many input channels (a group) ...
ROWS_NCHW_MIN_CHANNELS = 48
#: ... and output planes of at most this many pixels.
ROWS_NCHW_MAX_PLANE = 4096


def rows_nchw_ok(p, dtype=np.float32, target=None):
    """Whether an NCHW layer runs on the rows kernel (:func:`_run_rows`) rather than the
    taps kernel (:func:`_run_shifted`): one group, not 1x1 stride 1, at least
    ``ROWS_NCHW_MIN_CHANNELS`` channels, an output plane of at most
    ``ROWS_NCHW_MAX_PLANE`` pixels, and register tiles at least as full.

    The rows kernel's vectors run along the output channels (its tiles are ``MR``
    pixels of the whole batch by ``NR`` channels), the taps kernel's along an
    image's output plane (``MR`` channels by ``NR`` pixels): small planes leave the
    taps kernel's lanes empty (ResNet-18 conv5_x, 49 pixels, 64 lanes), output
    channels short of ``NR`` the rows kernel's.  Measured on an AVX-512 Zen 4
    (6x64 tile, fp32, 1 thread, batch 8, rows against taps in the same rounds):
    ResNet-18 conv2_x-conv5_x 1.04, 1.07, 1.03 and 1.45x, its stride-2 layers
    1.08 and 1.60x, 128 -> 64 channels at 14x14 1.07x, 5x5 at 28x28 1.05x; but
    96 output channels 0.80x, 16 or 3 input channels 0.24 and 0.62x, 32 channels
    0.97-0.99x, and planes of 112x112 and 224x224 0.93-0.96x (each tile reads
    its channels from that many pages; the rows kernel also writes C through a
    transposing copy).
    """
    if p.layout != "NCHW" or p.groups != 1 or p.pointwise:
        return False
    if p.Cg < ROWS_NCHW_MIN_CHANNELS or p.Ho * p.Wo > ROWS_NCHW_MAX_PLANE:
        return False
    target = engine.host_target(dtype) if target is None else target
    mr, nr = target.mr, target.nr
    pixels, plane = p.N * p.Ho * p.Wo, p.Ho * p.Wo
    rows_fill = p.Kg / engine.round_up(p.Kg, nr) * pixels / engine.round_up(pixels, mr)
    taps_fill = p.Kg / engine.round_up(p.Kg, mr) * plane / engine.round_up(plane, nr)
    return rows_fill >= taps_fill


def rows_kc(p, itemsize, MR, l1_bytes, a_l1=None):
    """KC of :func:`_run_rows`: channels per block, so that the input pixels a tile
    reads (kh rows of its MR pixels' receptive field) take ``a_l1`` of L1d.

    NHWC packs a pixel's channels together; NCHW spends a row's cache lines (and
    one more, for their alignment) on each channel.
    """
    a_l1 = ROWS_A_L1 if a_l1 is None else a_l1
    span = (MR - 1) * p.sx + (p.kw - 1) * p.dx + 1          # pixels in a row of the field
    if p.layout == "NCHW":
        per_channel = p.kh * (-(-span * itemsize // 64) + 1) * 64
    else:
        per_channel = p.kh * span * itemsize
    return engine.balanced_kc(p.Cg, max(1, int(l1_bytes * a_l1) // per_channel))


def rows_merged(p, KC):
    """Whether :func:`_run_rows` may read a kernel row's taps as one run of kw*C values."""
    return p.layout == "NHWC" and p.groups == 1 and KC >= p.Cg and p.dx == 1 and p.kw > 1


@functools.lru_cache(maxsize=256)
def _rows_plan(p, itemsize, threads, MR, NR, l1_bytes, l2_bytes, a_l1, b_l2, a_l2,
               tasks_per_thread):
    """Blocking and task split of :func:`_run_rows`, once per layer shape."""
    ntaps = p.kh * p.kw
    KC = rows_kc(p, itemsize, MR, l1_bytes, a_l1)
    Np = engine.round_up(p.Kg, NR)
    NC = max(NR, int(l2_bytes * b_l2) // (ntaps * KC * itemsize) // NR * NR)
    NC = engine.round_up(-(-Np // -(-Np // NC)), NR)                # equal blocks
    m = p.N * p.Ho * p.Wo
    # Pixels per task: their input rows for one KC block in a share of L2 (about
    # kh*sy rows of input per row of output), and in NCHW their C tile too, but
    # enough tasks for every thread.
    per_pixel = KC * itemsize * p.kh * p.sy + (Np * itemsize if p.layout == "NCHW" else 0)
    blocks = -(-m // max(MR, int(l2_bytes * a_l2) // per_pixel // MR * MR))
    parts = 1
    if threads > 1:
        want = threads * tasks_per_thread
        # Every block of pixels streams all the weights it multiplies: where they
        # outweigh the image, the tasks also split the output channels.
        weights = p.groups * ntaps * p.Cg * Np * itemsize
        if weights > p.N * p.H * p.W * p.C * itemsize:
            parts = max(1, min(Np // NR, -(-want // blocks)))
        blocks = max(blocks, -(-want // parts))
    MP = min(engine.round_up(-(-m // blocks), MR), engine.round_up(m, MR))
    KS = engine.round_up(-(-Np // parts), NR)                   # output channels a task
    parts = -(-Np // KS)
    # Few tasks come in a multiple of the threads, so that the threads end together.
    while threads > 1 and MP > MR and -(-m // MP) * parts % threads \
            and -(-m // MP) * parts < 32 * threads:
        MP -= MR
    ntasks = -(-m // MP) * parts
    merged = rows_merged(p, KC)
    offs = MP // MR * (ntaps * MR + 1)                  # see panel_stride
    if p.layout == "NCHW":
        zeros = (KC - 1) * p.H * p.W + 1            # read KC values H*W apart
        cbuf = MP * Np
    else:
        zeros = p.kw * p.Cg if merged else KC
        cbuf = 1
    return RowsPlan(KC, NC, MP, m, KS, parts, ntasks, max(1, min(threads, ntasks)), merged, offs,
                    zeros, cbuf)


@functools.lru_cache(maxsize=16)
def _zero_row(size, dtype):
    """``size`` zeros of ``dtype``, shared by every call: the rows kernel's padding row,
    read and never written (NCHW's is ``(KC-1)*H*W + 1`` long)."""
    return np.zeros(size, dtype)


def _run_rows(x, w, bias, out, p, act):
    """Convolution on the rows kernel: no patches, the image read where it lies.

    NHWC, any groups: C is the output itself.  NCHW, one group: each task's C
    goes through a per-thread buffer, transposed into the output's planes.
    """
    kernel, _ = engine.plan(out.dtype)
    mod = engine.family_module("rows", out.dtype)
    MR, NR = kernel.mr, kernel.nr
    machine = detect()
    plan = _rows_plan(p, out.dtype.itemsize, engine.threads_for(p.flops, 1 << 30), MR, NR,
                      machine.l1d_bytes, machine.l2_bytes, ROWS_A_L1, ROWS_B_L2, ROWS_A_L2,
                      ROWS_TASKS_PER_THREAD)
    bpack, Np = engine.prepared("im2col_rows", w, (plan.KC, NR),
                                lambda w: _pack_weights_rows(w, p, plan.KC, NR))
    if bias is None:
        b, epi = np.zeros(1, out.dtype), act
    else:
        b, epi = np.ascontiguousarray(bias, out.dtype), act | EPI_BIAS_COL
    zeros = _zero_row(plan.zeros, out.dtype.str)
    (offs,) = engine.thread_buffers(("im2col_rows", kernel.name), plan.threads, (plan.offs,),
                                    np.intp)
    if p.layout == "NCHW":
        (cbufs,) = engine.thread_buffers(("im2col_rows_c", kernel.name), plan.threads,
                                         (plan.cbuf,), out.dtype)
        args = (plan.ntasks, x.reshape(-1), p.geom(), p.C, bpack, Np, p.K, out.reshape(-1), b,
                epi, plan.KC, plan.NC, plan.MP, plan.m, plan.KS, plan.parts, zeros)
        engine.launch(lambda t, counter: mod.rows_nchw_tasks(counter, *args, offs[t], cbufs[t]),
                      plan.threads)
        return out
    args = (plan.ntasks, x.reshape(-1), p.geom(), p.C, p.Cg, p.groups, bpack, Np, p.K, p.Kg,
            out.reshape(-1), b, epi, plan.KC, plan.NC, plan.MP, plan.m, plan.KS, plan.parts,
            plan.merged, zeros)
    engine.launch(lambda t, counter: mod.rows_nhwc_tasks(counter, *args, offs[t]), plan.threads)
    return out


# --- NCHW without patch panels: B read in place from a padded, stride-split image ---------

#: Largest stride-split image copy (bytes, per thread) the path may make: the bound on
#: its extra memory, whatever the image size.  Copies past L2 still paid off: a 3.3 MB
#: copy (64 channels at 112x112) ran 22.1 ms against 27.7 ms packing patches.  The
#: stride-1 layout reads the image in place, whatever its size.
SHIFTED_MAX_BYTES = 4 << 20
#: Bytes of the C block (all output channels x a block of grid columns) kept in L2.
SHIFTED_C_BYTES = 1 << 19
#: Columns per GEMM over the images' tail columns (see ``shifted_tails``): two 64-wide
#: panels.
SHIFTED_TAIL_COLUMNS = 128
#: With several threads, images are cut into column parts (pixel blocks) until there
#: are this many tasks per thread: tasks are taken from a shared counter, so finer ones
#: even out threads the machine slows down or starts late.  Batch 8, 2 threads, median
#: of 11 alternated rounds: ResNet-18 conv3_x 1.50-1.81x one thread with a task per
#: image, 1.59-1.87x with four parts per image (three runs); ResNet-50's 256->64 1x1
#: 1.66x -> 1.90x.  Not for layers the taps path reads from a copy (3-5% slower):
#: every thread taking a part of an image copies all of it.
TASKS_PER_THREAD = 16
#: ... but a part keeps at least this many columns: every part streams all of A.
SHIFTED_PART_COLUMNS = 48
#: The same for the pixel blocks of the packing path, whose tasks also pack B.
IM2COL_PART_COLUMNS = 256


def _flat(p):
    """Whether B is read from the image itself: stride 1, the output as wide as the image."""
    return p.sy == 1 and p.sx == 1 and p.Wo == p.W




def _layout(p):
    """FLAT: the image itself.  PHASED: an unpadded stride-split copy whose planes are
    as wide as the output, so its grid is the output plane too.  PADDED: a zero-padded
    stride-split copy, wider than the output."""
    if _flat(p):
        return FLAT
    return PHASED if -(-p.W // p.sx) == p.Wo else PADDED


def _tap_rows_cols(kh, kw):
    """(i, j): kernel row and column of each tap, in the taps' order (column by column).

    Column by column, the taps reading left of a grid position come first: in the
    stride-1 layout they share one mask at a row's start, so the micro-kernel can
    mask their sum once instead of every load (see :func:`panel_masks`).
    """
    return np.tile(np.arange(kh), kw), np.repeat(np.arange(kw), kh)


@functools.lru_cache(maxsize=256)
def _phase_geometry(p):
    """(Hq, Wq, chan, taps) of the grid B is read on (see ``conv/_tile_taps.py``).

    The grid is ``Wq`` wide; tap ``t`` reads ``taps[t]`` elements from a grid
    position; channels are ``chan`` apart (the image's own channel stride for the
    stride-1 layout, else the stride-split copy's).  Cached per geometry: the
    arrays are shared, never written.
    """
    i, j = _tap_rows_cols(p.kh, p.kw)
    layout = _layout(p)
    if layout != PADDED:
        Hq, Wq = -(-p.H // p.sy), -(-p.W // p.sx)
        chan = p.input_strides()[1] if layout == FLAT else p.sy * p.sx * Hq * Wq
        return Hq, Wq, chan, _tap_offsets(p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, p.top, p.left,
                                          Hq, Wq)
    Hp = (p.Ho - 1) * p.sy + (p.kh - 1) * p.dy + 1
    Wp = (p.Wo - 1) * p.sx + (p.kw - 1) * p.dx + 1
    Hq, Wq = -(-Hp // p.sy), -(-Wp // p.sx)
    chan = p.sy * p.sx * Hq * Wq
    taps = (((i * p.dy % p.sy) * p.sx + j * p.dx % p.sx) * Hq * Wq
            + (i * p.dy // p.sy) * Wq + j * p.dx // p.sx)
    return Hq, Wq, chan, taps.astype(np.int64)


def _tap_offsets(kh, kw, sy, sx, dy, dx, top, left, Hq, Wq):
    """Each tap's offset from a grid position in unpadded stride-phase planes.

    Tap (i, j) reads pixel ``(oy*sy + i*dy - top, ox*sx + j*dx - left)``: in plane
    ``(a, b)`` (those offsets modulo the strides), ``r`` rows and ``c`` columns away
    (their floor quotients, negative above and left).  With stride 1 that is the
    image itself.
    """
    i, j = _tap_rows_cols(kh, kw)
    a, r = np.divmod(i * dy - top, sy)[::-1]
    b, c = np.divmod(j * dx - left, sx)[::-1]
    return ((a * sx + b) * Hq * Wq + r * Wq + c).astype(np.int64)


def panel_masks(p, nr, dtype, group=True):
    """Load masks of the layouts whose grid is the output plane: (masks, sched).

    Panel ``q // nr`` (grid columns ``q:q+nr``) masks its taps as the schedule
    ``sched[q // nr]`` says (see ``make_microkernel``).  A tap's lane is on (-1)
    when the pixel it reads for that lane lies in the image: its row and column
    inside, so nothing wraps round a row's edge, and its grid column before the end
    of the grid.  Taps with every lane on read unmasked.  With ``group`` (finite
    weights only), the longest run of first taps that share one pattern and read
    only inside memory (the image plane, or the copy and its slack) read unmasked,
    and their sum is masked once; other taps with lanes off use masked loads.
    ``masks`` holds each distinct pattern once.  The padded copy needs no masks.
    """
    T = p.kh * p.kw
    layout = _layout(p)
    if layout == PADDED:
        npanels = -(-p.Ho * _phase_geometry(p)[1] // nr)
        itype = np.int32 if np.dtype(dtype).itemsize == 4 else np.int64
        return np.zeros(1, itype), np.tile(np.r_[np.full(T, -1), 0, 0], (npanels, 1))
    return _panel_masks(p.H, p.W, p.Ho, p.Wo, p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, p.top,
                        p.left, nr, np.dtype(dtype).itemsize, group, layout == FLAT)


def _tap_pixels(Wo, kh, kw, sy, sx, dy, dx, top, left, q):
    """(row, col): the image pixel tap t reads for grid column q (output pixel
    ``q // Wo, q % Wo``), as arrays ``[..., t, q]``.

    ``q`` is an array whose last axis is the columns (the taps' axis is put before it).
    """
    i, j = (a[:, None] for a in _tap_rows_cols(kh, kw))
    row = q[..., None, :] // Wo * sy + i * dy - top
    col = q[..., None, :] % Wo * sx + j * dx - left
    return row, col


def _lanes_on(H, W, Ho, Wo, kh, kw, sy, sx, dy, dx, top, left, q):
    """Whether tap t's read for grid column q lies in the image: ``[..., t, q]``; columns
    past the grid are off (see :func:`_tap_pixels`)."""
    row, col = _tap_pixels(Wo, kh, kw, sy, sx, dy, dx, top, left, q)
    return (q[..., None, :] < Ho * Wo) & (row >= 0) & (row < H) & (col >= 0) & (col < W)


@functools.lru_cache(maxsize=256)
def _tail_reads(p, q0, q1):
    """Where each tap reads for output grid columns ``q0:q1`` in a channel of the image
    (``[t, i]``, elements), or -1 outside it.  Cached per geometry: shared, never
    written."""
    q = np.arange(q0, q1)
    geometry = (p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, p.top, p.left, q)
    row, col = _tap_pixels(p.Wo, *geometry)
    on = _lanes_on(p.H, p.W, p.Ho, p.Wo, *geometry)
    return np.where(on, row * p.input_strides()[2] + col, -1).astype(np.int64)


@functools.lru_cache(maxsize=64)
def _panel_masks(H, W, Ho, Wo, kh, kw, sy, sx, dy, dx, top, left, nr, itemsize, group, in_image):
    grid = Ho * Wo
    T = kh * kw
    npanels = -(-grid // nr)
    q = np.arange(npanels * nr).reshape(npanels, nr)
    on = _lanes_on(H, W, Ho, Wo, kh, kw, sy, sx, dy, dx, top, left, q)   # (panel, tap, lane)
    if in_image:
        # Unmasked reads must stay in the channel's plane (the image may end there).
        offsets = _tap_offsets(kh, kw, sy, sx, dy, dx, top, left, H, W)
        read = q[:, None, :] + offsets[None, :, None]
        safe = ((read >= 0) & (read < H * W)).all(axis=2)
    else:
        safe = np.ones((npanels, T), bool)                 # a copy with zeroed slack around
    patterns, which = np.unique(on.reshape(-1, nr), axis=0, return_inverse=True)
    which = which.reshape(npanels, T)
    masked = ~on.all(axis=2)
    # The group: taps 0..n-1, all masked, safe and of tap 0's pattern.
    same = masked & safe & (which == which[:, :1])
    n_and = np.where(group, np.cumprod(same, axis=1).sum(axis=1), 0)
    offs = np.where(masked & (np.arange(T) >= n_and[:, None]), which * nr, -1)
    sched = np.column_stack([offs, n_and, which[:, 0] * nr]).astype(np.int64)
    masks = np.where(patterns, -1, 0).astype(np.int32 if itemsize == 4 else np.int64).reshape(-1)
    return masks, sched                # cached: shared by every call with this geometry


def shifted_ok(p, dtype=np.float32):
    """Whether :func:`_run_shifted` serves ``p``: NCHW, not 1x1 stride 1, and stride 1
    with ``Wo == W`` (read in place) or a stride-split copy of a group's channels of
    at most ``SHIFTED_MAX_BYTES``.

    Whatever the channel count: the taps kernel sums every tap of a k block per C
    update, so few channels do not leave it dominated by C updates.  Zen 3, fp32,
    batch 8, 1 thread, against packing patches (same rounds): 8->8 channels at 56x56
    0.92 against 3.33 ms, 16->16 2.66 against 6.76, 3->16 at 224x224 10.5 against
    18.8, 32->64 stride 2 (a copy) 5.45 against 6.63; grouped layers gain most
    (ResNeXt's 128 channels in 32 groups at 56x56: 4.7 against 30.4 ms).

    1x1 stride-1 convolutions need no patches anyway (their packing is a row copy).
    """
    if p.layout != "NCHW" or p.pointwise:
        return False
    if _layout(p) == FLAT:
        return True                    # B is read from the image itself: no copy
    _, _, chan, _ = _phase_geometry(p)
    return p.Cg * chan * np.dtype(dtype).itemsize <= SHIFTED_MAX_BYTES


def _aliasing(stride_bytes, rows):
    """Whether more than two of ``rows`` rows ``stride_bytes`` apart (a tile of C) share
    L1 sets.

    Measured (1 thread, 64 channels, batch 2): a 6-row tile's rows all on the same
    sets (224x224 channels) ran 13% faster through a buffer; two per set (112x112)
    1% slower.
    """
    return -(-rows // l1_alias_period(stride_bytes)) > 2


@functools.lru_cache(maxsize=256)
def shifted_kc(p, mr, nr, itemsize, l1d_bytes):
    """Channels per k block of the taps kernel's layouts, in equal blocks.

    A tile sums every tap of a k block, so per channel it reads the distinct grid
    rows its taps fall on (``kh`` with stride 1; with stride 2, 3x3, six: two rows
    in each of two phase planes and one in the other two), each ``NR`` values plus
    the taps' column reach (and a line for their alignment), and ``MR*kh*kw``
    packed weights.  Both fit half of L1d, so the image rows stay there across the
    row panels down a column.  Measured on a Zen 3 (32 KiB L1d, 6x16 tile, batch 8,
    1 thread): 16-26 channels against 128 made ResNet-18 conv2_x 27.9 -> 24.5 ms,
    conv4_x 28.0 -> 25.1 ms; counting the stride-2 layer's six rows instead of
    three (16 channels, not 22) made it 4-6% faster again.

    The rows must also spread over L1's sets.  An x86 L1d is indexed within a 4 KiB
    page, so with channels ``S`` bytes apart the same row of every
    ``4096 / gcd(S, 4096)``-th channel falls on the same sets, of which there are
    ``l1d_bytes / 4096`` ways: at most that many channels per alias class.  VGG-16
    conv1_2 (224x224 channels, 49 pages apart) runs 8 channels a block, 1.45x faster
    than 22 (batch 2, one process, alternated).
    """
    i, j = _tap_rows_cols(p.kh, p.kw)
    rows = {((a * p.dy) % p.sy, (b * p.dx) % p.sx, (a * p.dy) // p.sy) for a, b in zip(i, j)}
    reach = (p.kw - 1) * p.dx // p.sx
    per_channel = len(rows) * ((nr + reach) * itemsize + 64) + mr * p.kh * p.kw * itemsize
    kc = max(8, l1d_bytes // 2 // per_channel)
    kc = max(1, min(kc, l1d_bytes // 4096 * l1_alias_period(_phase_geometry(p)[2] * itemsize)))
    return -(-p.Cg // -(-p.Cg // kc))


def _pack_groups_taps(w, groups, KC, MR):
    """Pack each group's weights as A for the taps kernel: (buffer, Mp).

    Group ``g`` starts at ``g*(T*Cg*Mp + 1)`` (``T = kh*kw``, ``Mp`` = ``Kg`` rounded up
    to MR).  In it, channel block ``pc`` starts at ``pc*Mp*T``; in that, the
    ``MR x kc`` panel of rows ``ir:ir+MR`` for tap ``t`` (its k steps of MR values)
    lies at ``ir*kc*T + t*MR*kc``.  A tile's every tap is then one contiguous run:
    read in order, where per-tap matrices would be ``C*Mp`` apart (9 streams 1 MB
    apart for 512 channels).  Array copies only, one per channel block: a Python
    loop over groups and taps cost 50x the layer on depthwise weights.
    """
    K, Cg, kh, kw = w.shape
    T, Kg = kh * kw, K // groups
    Mp = engine.round_up(Kg, MR)
    # (group, row, channel, tap), taps column by column (see _tap_rows_cols), rows
    # zero padded to Mp.
    a = np.zeros((groups, Mp, Cg, T), w.dtype)
    a[:, :Kg] = w.reshape(groups, Kg, Cg, kh, kw).transpose(0, 1, 2, 4, 3).reshape(
        groups, Kg, Cg, T)
    a_group = T * Cg * Mp + 1
    buf = np.zeros(groups * a_group, w.dtype)
    per_group = buf.reshape(groups, a_group)
    for pc in range(0, Cg, KC):
        kc = min(KC, Cg - pc)
        block = a[:, :, pc:pc + kc].reshape(groups, Mp // MR, MR, kc, T).transpose(0, 1, 4, 3, 2)
        per_group[:, pc * Mp * T:(pc + kc) * Mp * T] = block.reshape(groups, -1)
    return buf, Mp


def _taps_weights(w, groups, KC, MR):
    """(apack, Mp, finite): the taps kernel's packed weights of every group, cached
    (either layout: the same packing), and whether they are all finite, which allows
    masking a sum of taps instead of their loads (:func:`panel_masks`)."""
    return engine.prepared(
        "im2col_shifted", w, (groups, KC, MR),
        lambda w: _pack_groups_taps(w, groups, KC, MR) + (bool(np.isfinite(w).all()),))


def _group_bias(bias, p, Mp, dtype, act):
    """(bias, per-group stride, epilogue flags) for the taps task loops: each group's
    bias padded to its ``Mp`` rows (the row panels read whole tiles)."""
    if bias is None:
        return np.zeros(1, dtype), 0, act
    b = np.zeros((p.groups, Mp), dtype)
    b[:, :p.Kg] = bias.reshape(p.groups, p.Kg)
    return b.reshape(-1), Mp, act | EPI_BIAS_ROW


def _run_shifted(x, w, bias, out, p, act):
    """Convolution with every kernel tap summed per tile, B read in place.

    From the image itself with stride 1 and ``Wo == W``, else from a stride-split
    copy of each image, unpadded where its planes are as wide as the output
    (:func:`_layout`); see the section "im2col without patches" of
    ``conv/_tile_taps.py``.  Tasks are, for every group, images or parts of an image's
    column blocks (to balance the threads, see ``TASKS_PER_THREAD``), plus the
    batched tails (``shifted_tails``); a thread that copies keeps the image (group)
    it works on in its own buffer.  Each group's weights are packed on their own,
    its row panels start at its first output channel.
    """
    kernel, blk = engine.plan(out.dtype)
    mod = engine.family_module("taps", out.dtype)
    MR, NR = kernel.mr, kernel.nr
    KC = shifted_kc(p, MR, NR, out.itemsize, detect().l1d_bytes)
    apack, Mp, finite = _taps_weights(w, p.groups, KC, MR)
    threads = engine.threads_for(p.flops, 1 << 30)
    plan = _shifted_plan(p, out.dtype.str, threads, finite, MR, NR, KC, Mp,
                         SHIFTED_C_BYTES, SHIFTED_TAIL_COLUMNS, TASKS_PER_THREAD)
    b, bias_group, epi = _group_bias(bias, p, Mp, out.dtype, act)
    xqs, cbufs, bpacks = engine.thread_buffers(("im2col_shifted", kernel.name), plan.threads,
                                               plan.sizes, out.dtype)
    if plan.layout != FLAT:
        xqs[:, :plan.slack] = 0        # keep the slack finite (dropped columns read it)
        xqs[:, plan.slack + p.Cg * plan.chan:plan.sizes[0]] = 0
    args = (plan.ntasks, plan.parts, p.groups, apack.size // p.groups, bias_group,
            x.reshape(-1), 0, plan.xs, plan.geom, p.Cg, plan.taps, len(plan.taps), plan.masks,
            plan.sched, apack, Mp, p.Kg, out.reshape(-1), 0, plan.os, b, epi, KC, blk.mc,
            plan.NCB, plan.Hq, plan.Wq, plan.layout, plan.direct, plan.chan, plan.slack,
            plan.q_end, plan.reads, plan.tail_tasks, plan.tail_parts, plan.tail_imgs)
    engine.launch(lambda t, counter: mod.shifted_tasks(counter, *args, xqs[t], cbufs[t],
                                                       bpacks[t]), plan.threads)
    return out


ShiftedPlan = collections.namedtuple(
    "ShiftedPlan", "threads ntasks parts NCB layout Hq Wq chan taps masks sched direct q_end "
                   "reads tail_imgs tail_parts tail_tasks slack sizes xs os geom")


@functools.lru_cache(maxsize=256)
def _shifted_plan(p, dtype, threads, finite, MR, NR, KC, Mp, c_bytes, tail_columns,
                  tasks_per_thread):
    """What :func:`_run_shifted` derives from the geometry alone, once per layer shape.

    ``dtype`` is the output's dtype string, ``threads`` the most the call may use,
    ``finite`` whether the weights are finite; the tuning constants are arguments
    so that changing them takes effect.  Arrays in the plan are shared: never
    written.
    """
    itemsize = np.dtype(dtype).itemsize
    Hq, Wq, chan, taps = _phase_geometry(p)
    masks, sched = panel_masks(p, NR, dtype, group=finite)
    grid = p.Ho * Wq
    layout = _layout(p)
    direct = not _aliasing(p.output_strides()[1] * itemsize, MR)
    # The columns after the last whole panel of every image, as one GEMM of their own
    # (shifted_tails), when there are several images.
    q_end = grid // NR * NR
    if layout == PADDED or p.N == 1:
        q_end = grid
    reads = _tail_reads(p, q_end, max(grid, q_end + 1))
    # Up to ``tail_columns`` columns (whole images) per tails GEMM: its buffers do not
    # grow with the batch.
    tail_imgs = max(1, tail_columns // max(1, grid - q_end))
    tail_ld = engine.round_up(min(p.N, tail_imgs) * (grid - q_end), NR)
    # The copy: whole NR panels of taps reach before (PHASED) and after it: zeroed slack.
    slack = int(max(0, -taps.min())) + NR if layout == PHASED else 0
    if layout == FLAT:
        size = 1                       # B is read from the image: no copy
    else:
        size = slack + max(p.Cg * chan,
                           (p.Cg - 1) * chan + int(taps.max()) + engine.round_up(grid, NR) + 1)
    # Each image's (and group's) column blocks shared out in parts: read in place, for
    # enough tasks to balance the threads; copied, only when there are fewer images
    # than threads (every thread taking a part of an image copies all of it).
    images = p.N * p.groups
    parts = -(-threads // images)
    if layout == FLAT and threads > 1:
        parts = max(parts, min(-(-tasks_per_thread * threads // images),
                               q_end // SHIFTED_PART_COLUMNS))
    # At least one column block per part.
    NCB = _column_block(q_end, parts, Mp, itemsize, NR, c_bytes)
    parts = max(1, min(parts, -(-q_end // NCB)))
    # Each tails GEMM's rows shared out between the threads (a row panel at least) when
    # there are fewer tails GEMMs than threads: each share packs the tails again.
    tail_gemms = -(-p.N // tail_imgs) * p.groups
    tail_parts = min(threads, Mp // MR) if tail_gemms < threads else 1
    tail_tasks = -(-p.N // tail_imgs) * tail_parts if q_end < grid else 0
    ntasks = (p.N * parts + tail_tasks) * p.groups
    sizes = (size, Mp * max(NCB, tail_ld), max(1, tail_ld * len(taps) * KC))
    return ShiftedPlan(max(1, min(threads, ntasks)), ntasks, parts, NCB, layout, Hq, Wq, chan,
                       taps, masks, sched, direct, q_end, reads, tail_imgs, tail_parts,
                       tail_tasks, slack, sizes, p.input_strides(), p.output_strides(), p.geom())


# --- NHWC grouped: each group of an image copied as planes, then the taps kernel ---------

def planes_ok(p, dtype=np.float32, target=None):
    """Whether :func:`_run_planes` serves ``p`` (:func:`_planes_fit`) and wins: groups
    of fewer output channels than NR.

    The rows kernel's tiles are NR output channels of one group: with fewer, most of
    each tile is empty.  1 thread, batch 8, against torch channels-last: ResNeXt's 128
    channels in 32 groups at 56x56 (4 a group) 9.4 ms through planes, 24.1 by rows,
    torch 13.9; 64 channels in 8 groups 6.7 and 10.5 (torch 6.1).  From NR on, rows
    win: 64 channels in 2 groups 10.8 ms against 13.5 (torch 9.9), 512 in 32 groups
    at 14x14 3.1 against 3.9 (torch 3.3).
    """
    target = engine.host_target(dtype) if target is None else target
    return p.groups > 1 and p.Kg < target.nr and _planes_fit(p, dtype)


def _planes_fit(p, dtype):
    """Whether :func:`_run_planes` computes ``p``: NHWC, not 1x1, stride 1 with
    ``Wo == W``, and a task's planes of at most ``SHIFTED_MAX_BYTES``."""
    itemsize = np.dtype(dtype).itemsize
    return (p.layout == "NHWC" and not p.pointwise and _flat(p)
            and _planes_groups(p, itemsize) * p.Cg * p.H * p.W * itemsize <= SHIFTED_MAX_BYTES)


#: Bytes of input channels a task of the NHWC grouped path copies per pixel, at least:
#: whole cache lines, read once, and runs long enough for the copy to stream.  1
#: thread, batch 8, median of 7 rounds: ResNeXt's 128 channels in 32 groups at 56x56
#: 8.7 ms with 256 bytes (64 channels) a task, 9.7 with 64, 18.5 with one group.
PLANES_RUN_BYTES = 256


def _planes_groups(p, itemsize):
    """Groups per task of :func:`_run_planes`: a cache line of each pixel's channels."""
    return max(1, min(p.groups, -(-PLANES_RUN_BYTES // (p.Cg * itemsize))))


def _column_block(columns, parts, Mp, itemsize, NR, c_bytes):
    """Grid columns per block of C for the taps task loops: blocks as equal as possible,
    at least ``parts`` of them, each C block (``Mp`` rows) no larger than ``c_bytes``."""
    ncb = max(NR, c_bytes // (Mp * itemsize) // NR * NR)
    blocks = max(-(-columns // ncb), parts)
    return max(NR, engine.round_up(-(-columns // blocks), NR))


@functools.lru_cache(maxsize=256)
def _group_image(p):
    """One group of one image as an NCHW layer: the geometry of the planes copied."""
    return dataclasses.replace(p, N=1, C=p.Cg, K=p.Kg, groups=1, layout="NCHW")


def _run_planes(x, w, bias, out, p, act):
    """NHWC grouped convolution: tasks (image, block of groups, see ``PLANES_RUN_BYTES``)
    copy the block's channels as planes (``transpose_copy``), run the taps kernel over
    each group as over an NCHW image read in place (:func:`_run_shifted`) and write C
    back interleaved (``transpose_copy`` again)."""
    kernel, blk = engine.plan(out.dtype)
    mod = engine.family_module("planes", out.dtype)
    MR, NR = kernel.mr, kernel.nr
    q = _group_image(p)
    KC = shifted_kc(q, MR, NR, out.itemsize, detect().l1d_bytes)
    apack, Mp, finite = _taps_weights(w, p.groups, KC, MR)
    _, _, _, taps = _phase_geometry(q)
    masks, sched = panel_masks(q, NR, out.dtype, group=finite)
    pixels, out_pixels = p.H * p.W, p.Ho * p.Wo
    NCB = _column_block(out_pixels, 1, Mp, out.itemsize, NR, SHIFTED_C_BYTES)
    b, bias_group, epi = _group_bias(bias, p, Mp, out.dtype, act)
    G = _planes_groups(p, out.itemsize)
    ntasks = p.N * -(-p.groups // G)
    threads = min(engine.threads_for(p.flops, 1 << 30), ntasks)
    xqs, cbufs = engine.thread_buffers(("im2col_planes", kernel.name), threads,
                                       (G * p.Cg * pixels, ((G - 1) * p.Kg + Mp) * NCB),
                                       out.dtype)
    args = (ntasks, p.groups, G, apack.size // p.groups, bias_group, x.reshape(-1), p.C, pixels,
            out_pixels, p.Cg, taps, len(taps), masks, sched, apack, Mp, p.Kg, p.K, out.reshape(-1), b, epi,
            KC, blk.mc, NCB)
    engine.launch(lambda t, counter: mod.shifted_nhwc_tasks(counter, *args, xqs[t], cbufs[t]),
                  threads)
    return out
