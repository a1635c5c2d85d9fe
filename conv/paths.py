"""Every loop nest ``conv2d`` can run, by name, which one runs a given layer, and running it.

A path is ``"{algorithm}.{loop}"``: the algorithm a caller names (``im2col``,
``winograd``, ``direct``) and the loop nest that carries it out for the layer's
layout and shape.  The im2col loops are one module each: :mod:`~tilegemm.conv.im2col`
(``pointwise`` and ``packed``), :mod:`~tilegemm.conv.rows`, :mod:`~tilegemm.conv.taps`
and :mod:`~tilegemm.conv.planes`; each says through public predicates when it
serves a layer and when it wins.  :func:`path_of` is the one place that says which
path runs; ``conv2d`` dispatches on it (:func:`run`) and
:func:`tilegemm.conv_plan` reports it, so a test that records the paths of its
cases knows exactly what ran.  :func:`serves` says whether a path computes a layer
correctly whatever its speed: the paths that tests may force through ``conv2d``'s
internal ``_path`` argument.
"""
import numpy as np

from tilegemm.conv import direct, engine, im2col, planes, rows, taps, winograd
from tilegemm.ground.contracts import EPI_ACCUMULATE

#: The im2col loops other than ``pointwise``: the rows kernel (A's rows read in
#: place), the taps kernel (B read in place or from a stride-split copy), the taps
#: kernel over NHWC groups copied as planes, and B panels packed from the image.
ROWS, TAPS, PLANES, PACKED = "rows", "taps", "planes", "packed"
IM2COL_LOOPS = (ROWS, TAPS, PLANES, PACKED)

#: Every path, in the order of the algorithms.
PATHS = (("im2col.pointwise",) + tuple(f"im2col.{name}" for name in IM2COL_LOOPS)
         + ("winograd.nchw", "winograd.nhwc")
         + tuple(f"direct.{name}" for name in direct.PATHS))


def im2col_route(p, dtype=np.float32, target=None):
    """Which im2col loop runs ``p`` (1x1 stride-1 layers aside: ``pointwise``):
    ``ROWS``, ``TAPS``, ``PLANES`` or ``PACKED``.

    ``target`` (:data:`tilegemm.conv.engine.Target`) defaults to the host's."""
    target = engine.host_target(dtype) if target is None else target
    if p.layout == "NCHW":
        if rows.nchw_applies(p, dtype, target):
            return ROWS
        return TAPS if taps.serves(p, dtype) else PACKED
    return PLANES if planes.applies(p, dtype, target) else ROWS


def path_of(p, algorithm, dtype=np.float32, target=None):
    """The path ``algorithm`` takes for :class:`ConvParams` ``p`` on ``target``
    (:data:`tilegemm.conv.engine.Target`, the host's by default)."""
    if algorithm == "im2col":
        if p.pointwise and (p.layout == "NHWC" or im2col.reads_in_place(p)):
            target = engine.host_target(dtype) if target is None else target
            if p.layout == "NHWC" and p.Kg > target.nr:
                return "im2col.rows"
            return "im2col.pointwise"
        return "im2col." + im2col_route(p, dtype, target)
    if algorithm == "winograd":
        return "winograd." + p.layout.lower()
    if algorithm == "direct":
        return "direct." + direct.route(p, dtype, target)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def serves(path, p, dtype=np.float32):
    """Whether ``path`` computes ``p`` correctly on this host."""
    algorithm, _, loop = path.partition(".")
    if algorithm == "im2col":
        return {"pointwise": lambda: p.pointwise, PACKED: lambda: p.layout == "NCHW",
                TAPS: lambda: taps.serves(p, dtype), ROWS: lambda: rows.serves(p),
                PLANES: lambda: planes.serves(p, dtype)}.get(loop, lambda: False)()
    if algorithm == "winograd":
        return p.winograd_ok and loop == p.layout.lower()
    if algorithm == "direct":
        return loop in direct.PATHS and direct.serves(loop, p, dtype)
    return False


_IM2COL_RUNS = {"pointwise": im2col.pointwise, PACKED: im2col.run, ROWS: rows.run,
                TAPS: taps.run, PLANES: planes.run}


#: The NHWC paths that can add their result to what ``out`` holds (GEMM beta = 1).
ACCUMULATING = {"im2col.pointwise": im2col.pointwise, "im2col.rows": rows.run}
#: Winograd adds it in its output transform (EPI_ACCUMULATE), in either layout.
WINOGRAD = ("winograd.nchw", "winograd.nhwc")


def accumulates(path, p):
    """Whether ``path`` can add its result to what ``out`` holds, in the epilogue (before
    the activation): NHWC layers on a GEMM whose C is the output itself, and Winograd's
    output transform."""
    return (path in ACCUMULATING and p.layout == "NHWC") or path in WINOGRAD


def bind(path, w, bias, p, dtype, tile=2):
    """``run(x, out, act, accumulate=False)``: :func:`run` of ``path`` for the layer
    ``p`` with these weights and bias, its per-layer decisions made once where the
    path offers it (the rows and depthwise NHWC loops: the paths of small, many
    layers, whose Python cost per call shows)."""
    if path == "im2col.rows":
        return rows.bind(w, bias, p, dtype)
    if path == "direct." + direct.NHWC_VECTOR:
        vector = direct.bind_nhwc_vector(w, bias, p, dtype)
        return lambda x, out, act, accumulate=False: vector(x, out, act)
    return lambda x, out, act, accumulate=False: run(path, x, w, bias, out, p, act, tile,
                                                     accumulate)


def run(path, x, w, bias, out, p, act, tile=2, accumulate=False):
    """Run ``path`` (one of :data:`PATHS` that :func:`serves` ``p``) into ``out``.

    ``x`` is C-contiguous in ``p.layout``, ``w`` (K, C/groups, kh, kw) contiguous,
    ``out`` C-contiguous, ``act`` the activation's epilogue flags, ``tile`` the
    output tile size m of a Winograd path (F(m x m, 3x3)); ``accumulate`` (where
    :func:`accumulates`) adds the result to ``out``'s values before the activation."""
    algorithm, _, loop = path.partition(".")
    if accumulate and algorithm == "winograd":
        return winograd.run(x, w, bias, out, p, act | EPI_ACCUMULATE, tile=tile)
    if accumulate:
        return ACCUMULATING[path](x, w, bias, out, p, act, accumulate=True)
    if algorithm == "im2col":
        return _IM2COL_RUNS[loop](x, w, bias, out, p, act)
    if algorithm == "winograd":
        return winograd.run(x, w, bias, out, p, act, tile=tile)
    return direct.run(x, w, bias, out, p, act, loop)
