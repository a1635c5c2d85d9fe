"""Direct convolution: no packing, for the shapes where packing does not pay.

Depthwise and few-channel convolutions have a tiny reduction (C/groups * kh * kw),
so a GEMM would spend its time packing; large strides waste most of the patches.
Here each task accumulates a block of output channels x a whole output row in a
small L1-resident accumulator, with the vector lanes over the contiguous axis:

* NCHW -- lanes over the output width: for each kernel tap, one input row segment
  is multiplied into ``KB`` output-channel rows (each input value loaded once per
  block of channels).  With a horizontal stride of 1 the generated
  ``direct_nchw_task`` (``conv/_tile_direct.py``) runs instead: explicit vectors of
  output pixels, a channel's whole kernel window summed in one register.  Depthwise
  layers whose output is as wide as the image (or its stride-phase planes) run
  ``depthwise_flat_tasks``: the rows end to end as one vector run
  (:func:`flat_geometry`).
* NHWC -- lanes over the channels: for each output pixel and kernel tap, the
  pixel's channel vector is multiplied into the ``K`` accumulators.  Depthwise
  layers of at least two vectors of channels run the generated
  ``depthwise_nhwc_tasks``: whole vectors of channels summed in registers.

The bias and activation are applied to the accumulator before it is stored.
Geometry tuples are as in :mod:`tilegemm.packing.im2col`.
"""
import collections
import functools

import numba
import numpy as np

from tilegemm.ground.contracts import (EPI_BIAS_COL, EPI_BIAS_ROW, EPI_RELU, EPI_RELU6, JIT, cdiv,
                                       imin, inner_jit, jit, round_up)
from tilegemm.conv import engine
from tilegemm.conv.params import unique_rows
from tilegemm.kernels.sync import next_task
from tilegemm.packing.im2col import valid_range

#: Output channels accumulated together in NCHW (each input row is read once per block).
KB = 8
#: Outputs per task taken from the shared counter, at least (whole tasks).
TICK_OUTPUTS = 1 << 14


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
def _nchw_task(task, x, w, bias, has_bias, act, out, shape, geom, acc):
    """One (image, group, block of <= KB output channels): every output row.

    ``shape = (N, C, K, groups)``; ``x``, ``w``, ``out`` are flat C-contiguous NCHW /
    (K, C/groups, kh, kw) / NCHW arrays; ``acc`` holds KB*Wo elements.
    """
    N, C, K, groups = shape
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    Cg, Kg = C // groups, K // groups
    blocks = (Kg + KB - 1) // KB
    n = task // (groups * blocks)
    g = (task // blocks) % groups
    k0 = g * Kg + (task % blocks) * KB
    kn = imin(KB, (g + 1) * Kg - k0)
    for oh in range(Ho):
        acc[:kn * Wo] = 0
        for c in range(Cg):
            for i in range(kh):
                ih = oh * sy + i * dy - py
                if ih < 0 or ih >= H:
                    continue
                row = ((n * C + g * Cg + c) * H + ih) * W
                for j in range(kw):
                    iw0 = j * dx - px
                    lo, hi = valid_range(iw0, sx, Wo, W)
                    src = row + iw0
                    for kk in range(kn):
                        wv = w[(((k0 + kk) * Cg + c) * kh + i) * kw + j]
                        a = kk * Wo
                        if sx == 1:
                            for ow in range(lo, hi):
                                acc[a + ow] += wv * x[src + ow]
                        else:
                            for ow in range(lo, hi):
                                acc[a + ow] += wv * x[src + ow * sx]
        for kk in range(kn):
            dst = ((n * K + k0 + kk) * Ho + oh) * Wo
            for ow in range(Wo):
                y = acc[kk * Wo + ow]
                if has_bias:
                    y += bias[k0 + kk]
                out[dst + ow] = activate(y, act)


@numba.njit(inline='always', **JIT)
def _shape_geom(r):
    """A plan record's ``(N, C, K, groups)`` and geometry tuple (:meth:`ConvParams.geom`)."""
    return ((r.N, r.C, r.K, r.groups),
            (r.H, r.W, r.Ho, r.Wo, r.kh, r.kw, r.sy, r.sx, r.py, r.px, r.dy, r.dx))


@jit
def _nchw_tasks(counter, plan, x, w, bias, has_bias, act, out, acc):
    """Tasks of :func:`_nchw_task` taken from ``counter`` until ``ntasks`` are out;
    ``plan`` is :func:`direct_plan`'s record."""
    ntasks = plan[0].ntasks
    shape, geom = _shape_geom(plan[0])
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        _nchw_task(task, x, w, bias, has_bias, act, out, shape, geom, acc)



@inner_jit
def _nhwc_task(task, x, wt, bias, has_bias, act, out, shape, geom, acc):
    """One (image, output row): every pixel, every channel.

    ``wt`` is the weight laid out (kh, kw, C/groups, K) so that a kernel tap's
    weights for consecutive output channels are contiguous; ``acc`` holds K elements.
    """
    N, C, K, groups = shape
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    Cg, Kg = C // groups, K // groups
    n = task // Ho
    oh = task % Ho
    depthwise = Cg == 1 and Kg == 1
    for ow in range(Wo):
        acc[:K] = 0
        for i in range(kh):
            ih = oh * sy + i * dy - py
            if ih < 0 or ih >= H:
                continue
            for j in range(kw):
                iw = ow * sx + j * dx - px
                if iw < 0 or iw >= W:
                    continue
                src = ((n * H + ih) * W + iw) * C
                tap = (i * kw + j) * Cg * K
                if depthwise:
                    for k in range(K):
                        acc[k] += x[src + k] * wt[tap + k]
                else:
                    for g in range(groups):
                        for c in range(Cg):
                            xv = x[src + g * Cg + c]
                            wrow = tap + c * K + g * Kg
                            for kk in range(Kg):
                                acc[g * Kg + kk] += xv * wt[wrow + kk]
        dst = ((n * Ho + oh) * Wo + ow) * K
        for k in range(K):
            y = acc[k]
            if has_bias:
                y += bias[k]
            out[dst + k] = activate(y, act)


@jit
def _nhwc_tasks(counter, plan, x, wt, bias, has_bias, act, out, acc):
    """Tasks of :func:`_nhwc_task` taken from ``counter`` until ``ntasks`` are out;
    arguments as for :func:`_nchw_tasks`."""
    ntasks = plan[0].ntasks
    shape, geom = _shape_geom(plan[0])
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        _nhwc_task(task, x, wt, bias, has_bias, act, out, shape, geom, acc)



def _cover(first, n, size):
    """Starts (in vectors) of runs of ``size`` covering vectors ``first:first+n``, the last
    run overlapping the one before, and how many vectors they cover (0 if ``n < size``)."""
    if n < size:
        return np.zeros(0, np.int64), 0
    runs = first + np.arange(0, n - size + 1, size)
    if n % size:
        runs = np.append(runs, first + n - size)
    return runs.astype(np.int64), n


def flat_applies(p, lanes):
    """Whether a depthwise layer runs its rows end to end (:func:`flat_geometry`): NCHW,
    an output exactly as wide as the image's stride-phase planes, a whole vector of
    ``lanes`` outputs at least."""
    return (p.layout == "NCHW" and p.Cg == 1 and p.Kg == 1 and p.Wo == cdiv(p.W, p.sx)
            and p.Ho * p.Wo >= lanes)


@functools.lru_cache(maxsize=64)
def flat_geometry(p, lanes, vectors, short, dtype):
    """What ``depthwise_flat_tasks`` (``conv/_tile_direct.py``) needs for ``p``:
    ``(applies, (Hq, Wq), taps, masks, starts, rows, inner, colmask, blocks, shorts)``.

    It applies to depthwise NCHW layers whose output is exactly as wide as the
    image's stride-phase planes (``Wo == ceil(W / sx)``; with stride 1, the image)
    and holds a whole vector.  Split by stride phase into ``sy*sx`` planes of
    ``Hq x Wq`` (stride 1: the channel itself, else a copy), output rows lie end to
    end like the planes', and tap ``t = (i, j)`` of output pixel ``q`` reads element
    ``q + offset[t]`` of its plane -- ``r`` rows and ``c`` columns away, the floor
    quotients of ``i*dy - top`` and ``j*dx - left`` by the strides -- when that lies
    in the plane (in its row, not above or below it).  ``taps`` and ``inner`` start
    with the reads' offsets from the first plane.

    The output's vectors start every ``lanes`` pixels, the last one overlapping the
    one before, so every store is whole.  Those whose every read lies inside its
    plane are covered by runs of ``vectors`` (starting at pixels ``blocks``) or,
    when fewer, of ``short`` vectors (``shorts``), the last run overlapping the one
    before: they read unmasked and AND the lanes of tap ``t`` with
    ``colmask[inner[T + t] + q % Wq:]`` (-1: a tap that never crosses a row's
    edge).  The others, near the top and bottom, start at ``starts``: they load
    through ``masks[rows[v] + t*lanes:]`` (``taps[T + t] = t*lanes``).  Cached per
    geometry: shared, never written.
    """
    itype = np.int32 if np.dtype(dtype).itemsize == 4 else np.int64
    Hq, Wq = cdiv(p.H, p.sy), cdiv(p.W, p.sx)
    pixels = p.Ho * p.Wo
    none = np.zeros(0, np.int64)
    if not flat_applies(p, lanes):
        return (False, (Hq, Wq), none, np.zeros(lanes, itype), none, none, none,
                np.zeros(lanes, itype), none, none)
    T = p.kh * p.kw
    i, j = np.divmod(np.arange(T), p.kw)
    a, r = np.divmod(i * p.dy - p.top, p.sy)[::-1]
    b, c = np.divmod(j * p.dx - p.left, p.sx)[::-1]
    near = r * Wq + c                                  # from the grid position, in the plane
    offsets = (a * p.sx + b) * Hq * Wq + near
    grid = np.arange(0, pixels - lanes + 1, lanes)
    # The vectors whose reads stay inside their planes: one run, as the window moves
    # monotonically.
    inside = np.flatnonzero((grid + near.min() >= 0)
                            & (grid + lanes - 1 + near.max() < Hq * Wq))
    first, n = (int(inside[0]), len(inside)) if len(inside) else (0, 0)
    blocks, covered = _cover(first, n, vectors)
    shorts, covered = (none, covered) if covered else _cover(first, n, short)
    starts = np.delete(grid, np.arange(first, first + covered))
    if pixels % lanes:
        starts = np.append(starts, pixels - lanes)          # the last, overlapping vector
    # Load masks of the other vectors, one row per distinct pattern.
    q = starts[:, None, None] + np.arange(lanes)                   # (vector, 1, lane)
    row = q // Wq + r[None, :, None]
    col = q % Wq + c[None, :, None]
    on = (row >= 0) & (row < Hq) & (col >= 0) & (col < Wq)         # (vector, tap, lane)
    # (-1 for T*lanes, not -1: every vector may be interior, leaving no masked ones.)
    patterns, which = unique_rows(on.reshape(len(starts), T * lanes))
    masks = np.where(patterns, -1, 0).astype(itype).reshape(-1)
    if masks.size == 0:
        masks = np.zeros(lanes, itype)                 # no masked vector: never read
    rows = (which.reshape(-1) * T * lanes).astype(np.int64)
    taps = np.concatenate([offsets, np.arange(T) * lanes]).astype(np.int64)
    # Column masks, periodic in Wq, long enough for a run from any column: one row
    # per distinct column shift.
    span = Wq + vectors * lanes
    shifts, which = np.unique(c, return_inverse=True)
    cols = np.arange(span) % Wq + shifts[:, None]
    colmask = np.where((cols >= 0) & (cols < Wq), -1, 0).astype(itype).reshape(-1)
    inner = np.concatenate([offsets, np.where(c == 0, -1, which * span)]).astype(np.int64)
    return (True, (Hq, Wq), taps, masks, starts.astype(np.int64), rows, inner, colmask,
            (blocks * lanes).astype(np.int64), (shorts * lanes).astype(np.int64))


FlatPlan = collections.namedtuple("FlatPlan", "ntasks copy size grid numbers")


@functools.lru_cache(maxsize=64)
def flat_plan(p, lanes, vectors, short, dtype, tick_outputs):
    """What the rows-end-to-end depthwise loop (``depthwise_flat_tasks``) takes for
    ``p``, once per layer shape, or None where it does not apply: a channel a task,
    ``per_tick`` channels per counter tick (``tick_outputs`` outputs at least), the
    stride-phase copy's size (stride 1 reads the input in place), the geometry's
    arrays (:func:`flat_geometry`) and the record the loop reads
    (:func:`tilegemm.conv.engine.record`)."""
    flat = flat_geometry(p, lanes, vectors, short, np.dtype(dtype))
    if not flat[0]:
        return None
    Hq, Wq = flat[1]
    ntasks = p.N * p.C
    copy = p.sy * p.sx > 1
    size = p.sy * p.sx * Hq * Wq + lanes if copy else 1
    numbers = engine.record(ntasks=ntasks, per_tick=max(1, tick_outputs // (p.Ho * p.Wo)),
                            out_plane=p.Ho * p.Wo, copy=copy, Hq=Hq, Wq=Wq, p=p)
    return FlatPlan(ntasks, copy, size, tuple(flat[2:]), numbers)


def nhwc_vector_applies(p, dtype, lanes=None):
    """Whether the depthwise NHWC kernel (vectors of channels) serves ``p``: depthwise,
    NHWC, channels for at least ``DW_NHWC_VECTORS`` vectors of ``lanes`` (the host's
    by default)."""
    lanes = engine.host_target(dtype).lanes if lanes is None else lanes
    return (p.layout == "NHWC" and p.Cg == 1 and p.Kg == 1
            and p.C >= engine.family_module("direct", dtype).DW_NHWC_VECTORS * lanes)


#: The loops of :func:`run`: depthwise NCHW rows end to end (:func:`flat_applies`), the
#: generated vector loop along NCHW rows (horizontal stride 1), scalar NCHW, depthwise
#: NHWC on vectors of channels (:func:`nhwc_vector_applies`), scalar NHWC.
FLAT, NCHW_VECTOR, NCHW, NHWC_VECTOR, NHWC = ("flat", "nchw_vector", "nchw", "nhwc_vector",
                                              "nhwc")
PATHS = (FLAT, NCHW_VECTOR, NCHW, NHWC_VECTOR, NHWC)


def route(p, dtype=np.float32, target=None):
    """Which loop :func:`run` takes for ``p``; ``target`` defaults to the host's."""
    lanes = (engine.host_target(dtype) if target is None else target).lanes
    if p.layout == "NCHW":
        if flat_applies(p, lanes):
            return FLAT
        return NCHW_VECTOR if p.sx == 1 else NCHW
    return NHWC_VECTOR if nhwc_vector_applies(p, dtype, lanes) else NHWC


def serves(path, p, dtype=np.float32):
    """Whether loop ``path`` computes ``p`` on this host (the paths a caller may force)."""
    lanes = engine.host_target(dtype).lanes
    if path == FLAT:
        return flat_applies(p, lanes)
    if path in (NCHW_VECTOR, NCHW):
        return p.layout == "NCHW" and (path == NCHW or p.sx == 1)
    if path == NHWC_VECTOR:
        return nhwc_vector_applies(p, dtype, lanes)
    return path == NHWC and p.layout == "NHWC"


def run(x, w, bias, out, p, act, path=None):
    """Direct convolution into ``out`` (C-contiguous in ``p.layout``); any shape.

    ``path`` (one of :data:`PATHS` that :func:`serves` ``p``) overrides :func:`route`."""
    path = route(p, out.dtype) if path is None else path
    if path == NHWC_VECTOR:                 # its per-layer setup is bind's, made once
        return bind_nhwc_vector(w, bias, p, out.dtype)(x, out, act)
    has_bias = bias is not None
    b = np.ascontiguousarray(bias) if has_bias else np.zeros(1, out.dtype)
    geom = p.geom()
    xf, of = x.reshape(-1), out.reshape(-1)
    mod = engine.family_module("direct", out.dtype)
    if path == FLAT:
        plan = flat_plan(p, mod.LANES, mod.DW_FLAT_VECTORS, mod.DW_FLAT_SHORT, out.dtype.str,
                         TICK_OUTPUTS)
        if plan is None:
            raise ValueError(f"direct: the rows-end-to-end loop does not serve {p}")
        threads = engine.threads_for(p.flops, plan.ntasks)
        (planes,) = engine.thread_buffers("depthwise_flat", max(threads, 1), (plan.size,),
                                          out.dtype)
        wf = np.ascontiguousarray(w).reshape(-1)
        epi = act | (EPI_BIAS_ROW if has_bias else 0)
        engine.launch_tasks(mod.depthwise_flat_tasks, lambda t: (
            plan.numbers, plan.grid, xf, planes[t] if plan.copy else xf, wf, b, epi, of,
            planes[t]), threads)
        return out
    ntasks, plan = direct_plan(p, path, KB, TICK_OUTPUTS)
    if path == NCHW_VECTOR:
        # Stride 1 along the row: the generated vector loop (tilegemm.conv.engine).
        threads = engine.threads_for(p.flops, ntasks)
        # Depthwise layers copy each channel zero padded into acc (see direct_nchw_task).
        Hp, Wp = mod.depthwise_plane(geom)
        (accs,) = engine.thread_buffers("direct_nchw_vec", max(threads, 1),
                                        (max(KB * round_up(p.Wo, 64), Hp * Wp),),
                                        out.dtype)
        wf = np.ascontiguousarray(w).reshape(-1)
        engine.launch_tasks(mod.direct_nchw_tasks,
                            lambda t: (plan, xf, wf, b, has_bias, act, of, accs[t]), threads)
        return out
    if path == NCHW:
        threads = engine.threads_for(p.flops, ntasks)
        (accs,) = engine.thread_buffers("direct_nchw", max(threads, 1), (KB * p.Wo,), out.dtype)
        wf = np.ascontiguousarray(w).reshape(-1)
        tasks = _nchw_tasks
    else:
        threads = engine.threads_for(p.flops, ntasks)
        (accs,) = engine.thread_buffers("direct_nhwc", max(threads, 1), (p.K,), out.dtype)
        wf = np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(-1)
        tasks = _nhwc_tasks
    engine.launch_tasks(tasks, lambda t: (plan, xf, wf, b, has_bias, act, of, accs[t]), threads)
    return out


def bind_nhwc_vector(w, bias, p, dtype):
    """The depthwise NHWC loop (vectors of channels) for layer ``p`` with these weights
    and bias, as ``run(x, out, act)``, its bias and geometry settled once; the
    weights, (kh, kw, C) contiguous, come from the engine's cache on each call.

    A task is a band of output rows: up to DW_NHWC_BAND rows, fewer where that leaves
    fewer than 4 tasks a thread."""
    dtype = np.dtype(dtype)
    mod = engine.family_module("direct", dtype)
    b = np.zeros(1, dtype) if bias is None else np.ascontiguousarray(bias, dtype)
    has_bias = EPI_BIAS_COL if bias is not None else 0
    geom = p.geom()

    def run_bound(x, out, act):
        threads = engine.threads_for(p.flops, p.N * p.Ho)
        band = max(1, min(mod.DW_NHWC_BAND, p.N * p.Ho // (4 * threads)))
        wt = engine.prepared("direct_nhwc_vector", w, (),
                             lambda w: np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(-1))
        args = ((p.N * cdiv(p.Ho, band), band), x.reshape(-1), wt, b, act | has_bias,
                out.reshape(-1), geom, p.C)
        engine.launch_tasks(mod.depthwise_nhwc_tasks, lambda t: args, threads)
        return out
    return run_bound


@functools.lru_cache(maxsize=64)
def direct_plan(p, path, kb, tick_outputs):
    """``(ntasks, record)`` of loop ``path`` (not FLAT) for ``p``, once per layer shape:
    NCHW tasks are (image, group, block of ``kb`` output channels), taken ``per_tick``
    at a time (``tick_outputs`` outputs at least); NHWC tasks are output rows.  The
    record (:func:`tilegemm.conv.engine.record`) holds those numbers, ``N, C, K,
    groups`` and the geometry; the constants are arguments so that changing them takes
    effect."""
    if path in (NCHW_VECTOR, NCHW):
        ntasks = p.N * p.groups * cdiv(p.Kg, kb)
    else:
        ntasks = p.N * p.Ho
    per_tick = max(1, tick_outputs // (p.Ho * p.Wo * min(kb, p.Kg)))
    return ntasks, engine.record(ntasks=ntasks, per_tick=per_tick, KB=kb, N=p.N, C=p.C, K=p.K,
                                 groups=p.groups, p=p)
