"""Every loop nest ``conv2d`` can run, by name, and which one runs a given layer.

A path is ``"{algorithm}.{loop}"``: the algorithm a caller names (``im2col``,
``winograd``, ``direct``) and the loop nest that carries it out for the layer's
layout and shape.  :func:`path_of` is the one place that says which path runs;
``conv2d`` dispatches on it and :func:`tilegemm.conv_plan` reports it, so a test
that records the paths of its cases knows exactly what ran.  :func:`serves` says
whether a path computes a layer correctly whatever its speed: the paths that
tests may force through ``conv2d``'s internal ``_path`` argument.
"""
import numpy as np

from tilegemm.conv import direct, im2col

#: Every path, in the order of the algorithms.
PATHS = (("im2col.pointwise",) + tuple(f"im2col.{name}" for name in im2col.PATHS)
         + ("winograd.nchw", "winograd.nhwc")
         + tuple(f"direct.{name}" for name in direct.PATHS))


def path_of(p, algorithm, dtype=np.float32, target=None):
    """The path ``algorithm`` takes for :class:`ConvParams` ``p`` on ``target``
    (:data:`tilegemm.conv.engine.Target`, the host's by default)."""
    if algorithm == "im2col":
        if p.pointwise:
            return "im2col.pointwise"
        return "im2col." + im2col.route(p, dtype, target)
    if algorithm == "winograd":
        return "winograd." + p.layout.lower()
    if algorithm == "direct":
        return "direct." + direct.route(p, dtype, target)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def serves(path, p, dtype=np.float32):
    """Whether ``path`` computes ``p`` correctly on this host."""
    algorithm, _, loop = path.partition(".")
    if algorithm == "im2col":
        if loop == "pointwise":
            return p.pointwise
        return im2col.serves(loop, p, dtype)
    if algorithm == "winograd":
        return p.winograd_ok and loop == p.layout.lower()
    if algorithm == "direct":
        return loop in direct.PATHS and direct.serves(loop, p, dtype)
    return False
