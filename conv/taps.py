"""The taps path: every kernel tap summed per register tile, B read in place (NCHW).

Applies (:func:`serves`) to NCHW layers other than 1x1 stride 1: with stride 1 and
the output as wide as the image (layout ``FLAT``) B is read from the image itself,
through load masks; other strides read a stride-split copy of each image (a group's
channels), unpadded (``PHASED``) where its planes are as wide as the output, else
zero padded (``PADDED``), of at most ``TAPS_MAX_BYTES``.  The planner takes it for
NCHW layers the rows path does not win (:func:`tilegemm.conv.rows.nchw_applies`).

Cost: the GEMM itself (every tap of a KC block summed in registers, one C update
per block, so few channels are no handicap), plus the stride-split copy of each
image (:func:`copies`); no patch matrix.  The drivers are ``conv/_tile_taps.py``.
"""
import collections
import functools

import numpy as np

from tilegemm.conv import engine
from tilegemm.conv.params import unique_rows
from tilegemm.ground.contracts import EPI_BIAS_ROW, cdiv, round_up
from tilegemm.tuning.machine import detect, l1_alias_period

#: Where the taps kernel reads B: a zero-padded stride-split copy whose grid is wider
#: than the output; the image itself (stride 1, ``Wo == W``); an unpadded stride-split
#: copy whose planes are as wide as the output.
PADDED, FLAT, PHASED = 0, 1, 2

#: Largest stride-split image copy (bytes, per thread) the path may make: the bound on
#: its extra memory, whatever the image size (copies past L2 still pay off against
#: packing patches).  The stride-1 layout reads the image in place, whatever its size.
TAPS_MAX_BYTES = 4 << 20
#: Bytes of the C block (all output channels x a block of grid columns) kept in L2.
TAPS_C_BYTES = 1 << 19
#: Columns per GEMM over the images' tail columns (see ``taps_tails``): two 64-wide
#: panels.
TAPS_TAIL_COLUMNS = 128
#: ... but a part keeps at least this many columns: every part streams all of A.
TAPS_PART_COLUMNS = 48


def reads_image(p):
    """Whether B is read from the image itself: stride 1, the output as wide as the image."""
    return p.sy == 1 and p.sx == 1 and p.Wo == p.W




def layout_of(p):
    """FLAT: the image itself.  PHASED: an unpadded stride-split copy whose planes are
    as wide as the output, so its grid is the output plane too.  PADDED: a zero-padded
    stride-split copy, wider than the output."""
    if reads_image(p):
        return FLAT
    return PHASED if cdiv(p.W, p.sx) == p.Wo else PADDED


def _tap_rows_cols(kh, kw):
    """(i, j): kernel row and column of each tap, in the taps' order (column by column).

    Column by column, the taps reading left of a grid position come first: in the
    stride-1 layout they share one mask at a row's start, so the micro-kernel can
    mask their sum once instead of every load (see :func:`panel_masks`).
    """
    return np.tile(np.arange(kh), kw), np.repeat(np.arange(kw), kh)


@functools.lru_cache(maxsize=256)
def phase_geometry(p):
    """(Hq, Wq, chan, taps) of the grid B is read on (see ``conv/_tile_taps.py``).

    The grid is ``Wq`` wide; tap ``t`` reads ``taps[t]`` elements from a grid
    position; channels are ``chan`` apart (the image's own channel stride for the
    stride-1 layout, else the stride-split copy's).  Cached per geometry: the
    arrays are shared, never written.
    """
    i, j = _tap_rows_cols(p.kh, p.kw)
    layout = layout_of(p)
    if layout != PADDED:
        Hq, Wq = cdiv(p.H, p.sy), cdiv(p.W, p.sx)
        chan = p.input_strides()[1] if layout == FLAT else p.sy * p.sx * Hq * Wq
        return Hq, Wq, chan, _tap_offsets(p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, p.top, p.left,
                                          Hq, Wq)
    Hp = (p.Ho - 1) * p.sy + (p.kh - 1) * p.dy + 1
    Wp = (p.Wo - 1) * p.sx + (p.kw - 1) * p.dx + 1
    Hq, Wq = cdiv(Hp, p.sy), cdiv(Wp, p.sx)
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
    layout = layout_of(p)
    if layout == PADDED:
        npanels = cdiv(p.Ho * phase_geometry(p)[1], nr)
        itype = np.int32 if np.dtype(dtype).itemsize == 4 else np.int64
        return np.zeros(1, itype), np.tile(np.r_[np.full(T, -1), 0, 0], (npanels, 1))
    return _panel_masks(_mask_geometry(p), nr, np.dtype(dtype).itemsize, group, layout == FLAT)


def _mask_geometry(p):
    """What the masks depend on: ``(H, W, Ho, Wo, kh, kw, sy, sx, dy, dx, top, left)``,
    one hashable key for the layers that share them."""
    return (p.H, p.W, p.Ho, p.Wo, p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, p.top, p.left)


def _tap_pixels(Wo, kh, kw, sy, sx, dy, dx, top, left, q):
    """(row, col): the image pixel tap t reads for grid column q (output pixel
    ``q // Wo, q % Wo``), as arrays ``[..., t, q]``.

    ``q`` is an array whose last axis is the columns (the taps' axis is put before it).
    """
    i, j = (a[:, None] for a in _tap_rows_cols(kh, kw))
    row = q[..., None, :] // Wo * sy + i * dy - top
    col = q[..., None, :] % Wo * sx + j * dx - left
    return row, col


def _lanes_on(geometry, q):
    """Whether tap t's read for grid column q lies in the image: ``[..., t, q]``; columns
    past the grid are off (see :func:`_tap_pixels`).  ``geometry``: :func:`_mask_geometry`."""
    H, W, Ho, Wo, kh, kw, sy, sx, dy, dx, top, left = geometry
    row, col = _tap_pixels(Wo, kh, kw, sy, sx, dy, dx, top, left, q)
    return (q[..., None, :] < Ho * Wo) & (row >= 0) & (row < H) & (col >= 0) & (col < W)


@functools.lru_cache(maxsize=256)
def _tail_reads(p, q0, q1):
    """Where each tap reads for output grid columns ``q0:q1`` in a channel of the image
    (``[t, i]``, elements), or -1 outside it.  Cached per geometry: shared, never
    written."""
    q = np.arange(q0, q1)
    row, col = _tap_pixels(p.Wo, p.kh, p.kw, p.sy, p.sx, p.dy, p.dx, p.top, p.left, q)
    on = _lanes_on(_mask_geometry(p), q)
    return np.where(on, row * p.input_strides()[2] + col, -1).astype(np.int64)


@functools.lru_cache(maxsize=64)
def _panel_masks(geometry, nr, itemsize, group, in_image):
    """:func:`panel_masks` for a :func:`_mask_geometry`, cached per geometry."""
    H, W, Ho, Wo, kh, kw, sy, sx, dy, dx, top, left = geometry
    grid = Ho * Wo
    T = kh * kw
    npanels = cdiv(grid, nr)
    q = np.arange(npanels * nr).reshape(npanels, nr)
    on = _lanes_on(geometry, q)   # (panel, tap, lane)
    if in_image:
        # Unmasked reads must stay in the channel's plane (the image may end there).
        offsets = _tap_offsets(kh, kw, sy, sx, dy, dx, top, left, H, W)
        read = q[:, None, :] + offsets[None, :, None]
        safe = ((read >= 0) & (read < H * W)).all(axis=2)
    else:
        safe = np.ones((npanels, T), bool)                 # a copy with zeroed slack around
    patterns, which = unique_rows(on.reshape(-1, nr))
    which = which.reshape(npanels, T)
    masked = ~on.all(axis=2)
    # The group: taps 0..n-1, all masked, safe and of tap 0's pattern.
    same = masked & safe & (which == which[:, :1])
    n_and = np.where(group, np.cumprod(same, axis=1).sum(axis=1), 0)
    offs = np.where(masked & (np.arange(T) >= n_and[:, None]), which * nr, -1)
    sched = np.column_stack([offs, n_and, which[:, 0] * nr]).astype(np.int64)
    masks = np.where(patterns, -1, 0).astype(np.int32 if itemsize == 4 else np.int64).reshape(-1)
    return masks, sched                # cached: shared by every call with this geometry


def serves(p, dtype=np.float32):
    """Whether :func:`run` serves ``p``: NCHW, not 1x1 stride 1, and stride 1
    with ``Wo == W`` (read in place) or a stride-split copy of a group's channels of
    at most ``TAPS_MAX_BYTES``.

    Whatever the channel count: the taps kernel sums every tap of a k block per C
    update, so few channels do not leave it dominated by C updates; grouped layers
    gain most against packing patches (docs/conv-paths.md).

    1x1 stride-1 convolutions need no patches anyway (their packing is a row copy).
    """
    if p.layout != "NCHW" or p.pointwise:
        return False
    if layout_of(p) == FLAT:
        return True                    # B is read from the image itself: no copy
    _, _, chan, _ = phase_geometry(p)
    return p.Cg * chan * np.dtype(dtype).itemsize <= TAPS_MAX_BYTES


def aliasing(stride_bytes, rows):
    """Whether more than two of ``rows`` rows ``stride_bytes`` apart (a tile of C) share
    L1 sets: such a tile's C then goes through a buffer (docs/conv-paths.md).
    """
    return cdiv(rows, l1_alias_period(stride_bytes)) > 2


@functools.lru_cache(maxsize=256)
def taps_kc(p, mr, nr, itemsize, l1d_bytes):
    """Channels per k block of the taps kernel's layouts, in equal blocks.

    A tile sums every tap of a k block, so per channel it reads the distinct grid
    rows its taps fall on (``kh`` with stride 1; with stride 2, 3x3, six: two rows
    in each of two phase planes and one in the other two), each ``NR`` values plus
    the taps' column reach (and a line for their alignment), and ``MR*kh*kw``
    packed weights.  Both fit half of L1d, so the image rows stay there across the
    row panels down a column.

    The rows must also spread over L1's sets.  An x86 L1d is indexed within a 4 KiB
    page, so with channels ``S`` bytes apart the same row of every
    ``4096 / gcd(S, 4096)``-th channel falls on the same sets, of which there are
    ``l1d_bytes / 4096`` ways: at most that many channels per alias class.
    Measurements: docs/conv-paths.md.
    """
    i, j = _tap_rows_cols(p.kh, p.kw)
    rows = {((a * p.dy) % p.sy, (b * p.dx) % p.sx, (a * p.dy) // p.sy) for a, b in zip(i, j)}
    reach = (p.kw - 1) * p.dx // p.sx
    per_channel = len(rows) * ((nr + reach) * itemsize + 64) + mr * p.kh * p.kw * itemsize
    kc = max(8, l1d_bytes // 2 // per_channel)
    kc = max(1, min(kc, l1d_bytes // 4096 * l1_alias_period(phase_geometry(p)[2] * itemsize)))
    return cdiv(p.Cg, cdiv(p.Cg, kc))


def pack_weights(w, groups, KC, MR):
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
    Mp = round_up(Kg, MR)
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


def weights(w, groups, KC, MR):
    """(apack, Mp, finite): the taps kernel's packed weights of every group, cached
    (either layout: the same packing), and whether they are all finite, which allows
    masking a sum of taps instead of their loads (:func:`panel_masks`)."""
    return engine.prepared(
        "im2col_taps", w, (groups, KC, MR),
        lambda w: pack_weights(w, groups, KC, MR) + (bool(np.isfinite(w).all()),))


def group_bias(bias, p, Mp, dtype, act):
    """(bias, per-group stride, epilogue flags) for the taps task loops: each group's
    bias padded to its ``Mp`` rows (the row panels read whole tiles)."""
    if bias is None:
        return np.zeros(1, dtype), 0, act
    b = np.zeros((p.groups, Mp), dtype)
    b[:, :p.Kg] = bias.reshape(p.groups, p.Kg)
    return b.reshape(-1), Mp, act | EPI_BIAS_ROW


def run(x, w, bias, out, p, act):
    """Convolution with every kernel tap summed per tile, B read in place.

    From the image itself with stride 1 and ``Wo == W``, else from a stride-split
    copy of each image, unpadded where its planes are as wide as the output
    (:func:`layout_of`); see the section "im2col without patches" of
    ``conv/_tile_taps.py``.  Tasks are, for every group, images or parts of an image's
    column blocks (to balance the threads, see ``engine.TASKS_PER_THREAD``), plus the
    batched tails (``taps_tails``); a thread that copies keeps the image (group)
    it works on in its own buffer.  Each group's weights are packed on their own,
    its row panels start at its first output channel.
    """
    kernel, blk = engine.gemm_kernel(out.dtype)
    mod = engine.family_module("taps", out.dtype)
    MR, NR = kernel.mr, kernel.nr
    KC = taps_kc(p, MR, NR, out.itemsize, detect().l1d_bytes)
    apack, Mp, finite = weights(w, p.groups, KC, MR)
    threads = engine.threads_for(p.flops, 1 << 30)
    plan = taps_plan(p, out.dtype.str, threads, finite, MR, NR, KC, Mp, blk.mc,
                     TAPS_C_BYTES, TAPS_TAIL_COLUMNS, engine.TASKS_PER_THREAD)
    b, bias_group, epi = group_bias(bias, p, Mp, out.dtype, act)
    xqs, cbufs, bpacks = engine.thread_buffers(("im2col_taps", kernel.name), plan.threads,
                                               plan.sizes, out.dtype)
    if plan.layout != FLAT:
        xqs[:, :plan.slack] = 0        # keep the slack finite (dropped columns read it)
        xqs[:, plan.slack + p.Cg * plan.chan:plan.sizes[0]] = 0
    grid = (plan.taps, plan.masks, plan.sched)
    # None for what the layer does not use (tails, the image copy, padding): the task
    # loop is then compiled without it.
    reads = plan.reads if plan.tail_tasks else None
    copies = plan.layout != FLAT
    padded = True if plan.layout == PADDED else None
    x, out1 = x.reshape(-1), out.reshape(-1)
    engine.launch_tasks(mod.taps_tasks, lambda t: (plan.numbers, grid, reads, x, apack,
                                                   (b, bias_group, epi), out1, (cbufs[t], bpacks[t]),
                                                   xqs[t] if copies else None, padded),
                        plan.threads)
    return out


TapsPlan = collections.namedtuple(
    "TapsPlan", "threads ntasks parts NCB layout Hq Wq chan taps masks sched direct q_end "
                "reads tail_imgs tail_parts tail_tasks slack sizes numbers")


@functools.lru_cache(maxsize=256)
def taps_plan(p, dtype, threads, finite, MR, NR, KC, Mp, MC, c_bytes, tail_columns,
              tasks_per_thread):
    """What :func:`run` derives from the geometry alone, once per layer shape.

    ``dtype`` is the output's dtype string, ``threads`` the most the call may use,
    ``finite`` whether the weights are finite, ``KC``, ``Mp`` and ``MC`` the
    blocking; the tuning constants are arguments so that changing them takes
    effect.  Arrays in the plan are shared: never written.  ``numbers`` is what the
    task loops read (:func:`tilegemm.conv.engine.record`): the blocking, the task
    split, the grid, the geometry and the strides.
    """
    itemsize = np.dtype(dtype).itemsize
    Hq, Wq, chan, taps = phase_geometry(p)
    masks, sched = panel_masks(p, NR, dtype, group=finite)
    grid = p.Ho * Wq
    layout = layout_of(p)
    direct = not aliasing(p.output_strides()[1] * itemsize, MR)
    # The columns after the last whole panel of every image, as one GEMM of their own
    # (taps_tails), when there are several images.
    q_end = grid // NR * NR
    if layout == PADDED or p.N == 1:
        q_end = grid
    reads = _tail_reads(p, q_end, max(grid, q_end + 1))
    # Up to ``tail_columns`` columns (whole images) per tails GEMM: its buffers do not
    # grow with the batch.
    tail_imgs = max(1, tail_columns // max(1, grid - q_end))
    tail_ld = round_up(min(p.N, tail_imgs) * (grid - q_end), NR)
    # The copy: whole NR panels of taps reach before (PHASED) and after it: zeroed slack.
    slack = int(max(0, -taps.min())) + NR if layout == PHASED else 0
    if layout == FLAT:
        size = 1                       # B is read from the image: no copy
    else:
        size = slack + max(p.Cg * chan,
                           (p.Cg - 1) * chan + int(taps.max()) + round_up(grid, NR) + 1)
    # Each image's (and group's) column blocks shared out in parts: read in place, for
    # enough tasks to balance the threads; copied, only when there are fewer images
    # than threads (every thread taking a part of an image copies all of it).
    images = p.N * p.groups
    parts = cdiv(threads, images)
    if layout == FLAT and threads > 1:
        parts = max(parts, min(cdiv(tasks_per_thread * threads, images),
                               q_end // TAPS_PART_COLUMNS))
    # At least one column block per part.
    NCB = column_block(q_end, parts, Mp, itemsize, NR, c_bytes)
    parts = max(1, min(parts, cdiv(q_end, NCB)))
    # Each tails GEMM's rows shared out between the threads (a row panel at least) when
    # there are fewer tails GEMMs than threads: each share packs the tails again.
    tail_gemms = cdiv(p.N, tail_imgs) * p.groups
    tail_parts = min(threads, Mp // MR) if tail_gemms < threads else 1
    tail_tasks = cdiv(p.N, tail_imgs) * tail_parts if q_end < grid else 0
    ntasks = (p.N * parts + tail_tasks) * p.groups
    sizes = (size, Mp * max(NCB, tail_ld), max(1, tail_ld * len(taps) * KC))
    numbers = engine.record(
        ntasks=ntasks, parts=parts, groups=p.groups, a_group=len(taps) * p.Cg * Mp + 1,
        Cg=p.Cg, M=p.Kg, Mp=Mp, ntaps=len(taps), KC=KC, MC=MC, NCB=NCB, Hq=Hq, Wq=Wq,
        layout=layout, direct=direct, chan=chan, slack=slack, q_end=q_end,
        tail_tasks=tail_tasks, tail_parts=tail_parts, tail_imgs=tail_imgs, p=p)
    return TapsPlan(max(1, min(threads, ntasks)), ntasks, parts, NCB, layout, Hq, Wq, chan,
                    taps, masks, sched, direct, q_end, reads, tail_imgs, tail_parts,
                    tail_tasks, slack, sizes, numbers)




def column_block(columns, parts, Mp, itemsize, NR, c_bytes):
    """Grid columns per block of C for the taps task loops: blocks as equal as possible,
    at least ``parts`` of them, each C block (``Mp`` rows) no larger than ``c_bytes``."""
    ncb = max(NR, c_bytes // (Mp * itemsize) // NR * NR)
    blocks = max(cdiv(columns, ncb), parts)
    return max(NR, round_up(cdiv(columns, blocks), NR))



def copies(p):
    """Whether the path reads a stride-split copy of each image (not the image itself)."""
    return layout_of(p) != FLAT
