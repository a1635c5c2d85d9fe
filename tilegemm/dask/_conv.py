"""Convolutions and networks over dask arrays of images, one tilegemm call per chunk."""
import os
import threading
import uuid
import weakref

import numpy as np

import dask
import dask.array as da
from dask.base import tokenize

import tilegemm
from tilegemm.dask import _worker
from tilegemm.ground.validate import check_threads

#: conv2d's keyword options passed through to every chunk's call.
OPTIONS = ("activation", "algorithm", "winograd_tile")
#: Where the image rows, columns and channels are in each layout.
AXES = {"NCHW": (2, 3, 1), "NHWC": (1, 2, 3)}

_network_tokens = weakref.WeakKeyDictionary()     # Network -> its token
_tokens_lock = threading.Lock()


def _conv_task(x, weight, bias, token, geometry, pads, threads):
    """One chunk: tilegemm.conv2d with the worker's prepared weights.  ``pads`` are
    the window's zero rows and columns (top, bottom, left, right) where they differ
    from the layer's own padding (a window at the image's edge)."""
    prepared = _worker.cached("conv", token, lambda: tilegemm.ConvWeights(weight))
    stride, padding, dilation, groups, layout, options = geometry
    if pads is not None:
        h, w, _ = AXES[layout]
        widths = [(0, 0)] * 4
        widths[h], widths[w] = pads[:2], pads[2:]
        x = np.pad(x, widths) if any(pads) else x
        padding = 0
    return _worker.run(threads, tilegemm.conv2d, x, prepared, bias, stride, padding,
                       dilation, groups, layout=layout, **options)


def _out_chunks(in_chunks, extent_in, extent_out):
    """Output chunks along one axis, cut where the input's are (in proportion)."""
    bounds = np.cumsum((0,) + tuple(in_chunks))
    cuts = sorted({round(b * extent_out / extent_in) for b in bounds} | {0, extent_out})
    return tuple(int(b - a) for a, b in zip(cuts, cuts[1:]) if b > a) or (extent_out,)


def _windows(out_chunks, extent, stride, dilation, kernel, before):
    """For each output chunk: the input rows it reads, clipped to the image, and the
    zero rows it needs above and below them (a chunk may lie wholly in the padding)."""
    windows, start = [], 0
    for size in out_chunks:
        lo = start * stride - before
        hi = (start + size - 1) * stride - before + dilation * (kernel - 1) + 1
        first = min(max(lo, 0), extent)
        last = max(min(hi, extent), first)
        above = min(max(-lo, 0), hi - lo)
        windows.append((first, last, above, (hi - lo) - above - (last - first)))
        start += size
    return windows


def _spatial(x, call, p):
    """The convolution of an image cut into spatial chunks: each output chunk from
    the input window its kernels read (the halo of its neighbours included)."""
    h, w, _ = AXES[p.layout]
    rows = _out_chunks(x.chunks[h], p.H, p.Ho)
    cols = _out_chunks(x.chunks[w], p.W, p.Wo)
    row_windows = _windows(rows, p.H, p.sy, p.dy, p.kh, p.top)
    col_windows = _windows(cols, p.W, p.sx, p.dx, p.kw, p.left)
    band = []
    for (r0, r1, top, bottom), ho in zip(row_windows, rows):
        pieces = []
        for (c0, c1, left, right), wo in zip(col_windows, cols):
            index = [slice(None)] * 4
            index[h], index[w] = slice(r0, r1), slice(c0, c1)
            window = x[tuple(index)].rechunk({h: -1, w: -1})
            pieces.append(call(window, (top, bottom, left, right), ho, wo))
        band.append(da.concatenate(pieces, axis=w))
    return da.concatenate(band, axis=h)


def _known_shape(x, func):
    if any(np.isnan(extent) for extent in x.shape):
        raise ValueError(f"{func}: the input's chunk sizes are unknown (shape {x.shape}); "
                         "call compute_chunk_sizes() first")


def _as_images(x, func):
    if isinstance(x, da.Array):
        return x
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"{func}: input must be 4-D (a batch of images), got shape {x.shape}")
    return da.from_array(x, chunks=(1,) + x.shape[1:])


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
           layout="NCHW", threads=None, **options):
    """:func:`tilegemm.conv2d` of a dask array of images, one call per chunk.

    Parameters
    ----------
    x : dask.array.Array or array_like
        Images in ``layout``, chunked along the batch and, optionally, over the
        image rows and columns: each output chunk is then computed from the input
        window its kernels read, the halo taken from the neighbouring chunks (any
        stride, padding and dilation).  Channels are made one chunk.  A numpy array
        is cut into one image per chunk.
    weight, bias : array_like
        As for :func:`tilegemm.conv2d` (plain arrays); they enter the graph once,
        and each worker process prepares the weights (:class:`tilegemm.ConvWeights`)
        once for all its tasks.
    stride, padding, dilation, groups, layout
        As for :func:`tilegemm.conv2d`.
    threads : int, optional
        tilegemm threads per task (default: the worker's share of its cores).
    **options
        ``activation``, ``algorithm``, ``winograd_tile`` as for :func:`tilegemm.conv2d`.

    Returns
    -------
    dask.array.Array
        The output in ``layout``, chunked like the input along the batch.

    Raises
    ------
    TypeError, ValueError
        As :func:`tilegemm.conv2d` would for these shapes, at graph construction.
    """
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"tilegemm.dask.conv2d: unsupported option(s) {sorted(unknown)}; "
                        f"takes {list(OPTIONS)} (residual= and out= are not supported)")
    x = _as_images(x, "tilegemm.dask.conv2d")
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"tilegemm.dask.conv2d: input has dtype {x.dtype}; "
                        "float32 and float64 are supported")
    _known_shape(x, "tilegemm.dask.conv2d")
    p, dtype, weight, bias = tilegemm.conv.PreparedConv.checked(
        x.shape, weight, bias, stride, padding, dilation, groups, layout=layout, dtype=x.dtype,
        **options)
    h, w, c = AXES[p.layout]
    x = x.rechunk({c: -1})
    # A frozen copy: the token names these values even if the caller's array changes.
    weight = np.array(weight, copy=True)
    weight.flags.writeable = False
    token = tokenize(weight)
    weight_key = dask.delayed(weight, pure=True)
    bias_key = None if bias is None else dask.delayed(np.array(bias, copy=True), pure=True)
    geometry = (stride, padding, dilation, groups, p.layout, options)
    threads = check_threads(threads, "tilegemm.dask.conv2d")

    def call(images, pads, ho, wo):
        shape = [None] * 4
        shape[0], shape[c], shape[h], shape[w] = images.chunks[0], (p.K,), (ho,), (wo,)
        return images.map_blocks(_conv_task, weight_key, bias_key, token, geometry, pads,
                                 threads, chunks=tuple(shape), dtype=dtype)

    if len(x.chunks[h]) == 1 and len(x.chunks[w]) == 1:
        return call(x, None, p.Ho, p.Wo)
    return _spatial(x, call, p)


def _network_task(graph, token, layout_transform, name, x, threads):
    """One batch chunk through this worker's copy of the network."""
    net = _worker.cached("network", token, lambda: tilegemm.Network(graph, layout_transform))
    return _worker.run(threads, net.run, {name: x})


def _as_network(net):
    """The Network and its token: one per Network object, else one per model's bytes
    (so that a model passed again as a path or bytes is not built again on the workers)."""
    if isinstance(net, tilegemm.Network):
        with _tokens_lock:
            return net, _network_tokens.setdefault(net, uuid.uuid4().hex)
    if isinstance(net, (str, os.PathLike)) and os.path.exists(net):
        with open(net, "rb") as f:
            data = f.read()
    elif isinstance(net, bytes):
        data = net
    elif hasattr(net, "SerializeToString"):
        data = net.SerializeToString()
    else:
        return tilegemm.load_onnx(net), uuid.uuid4().hex     # load_onnx says what is wrong
    return tilegemm.load_onnx(data), tokenize(data)


def _probe(net, name, x):
    """Each output's shape for one item and dtype, from an all-NCHW run of two zero
    items here (no planning): the first axis of every output must be the batch."""
    outputs = tilegemm.Network(net.graph, layout_transform=False).run(
        {name: np.zeros((2,) + x.shape[1:], dtype=x.dtype)})
    for out, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != 2:
            raise ValueError(f"tilegemm.dask.run_network: output {out!r} has shape "
                             f"{value.shape} for two items: its first axis is not the batch")
    return {out: (value.shape[1:], value.dtype) for out, value in outputs.items()}


def run_network(net, x, *, threads=None):
    """Run the batch chunks of ``x`` through a network, one copy loaded per worker.

    Parameters
    ----------
    net : tilegemm.Network, or what :func:`tilegemm.load_onnx` takes
        A one-input network.  It enters the graph once; each worker process builds
        its own :class:`tilegemm.Network` from it once (planning its layouts on its
        first chunk, the timings cached on disk per machine).
    x : dask.array.Array or array_like
        The input, chunked along its first (batch) axis; other axes are made one chunk.
    threads : int, optional
        tilegemm threads per task (default: the worker's share of its cores).

    Returns
    -------
    dask.array.Array or tuple
        The output, chunked like ``x`` along the batch; a tuple of them in the
        model's output order for a network with several (as ``net(x)`` returns).

    Raises
    ------
    ValueError
        A network with several inputs, or an output whose first axis is not the batch.
    """
    net, token = _as_network(net)
    if len(net.inputs) != 1:
        raise ValueError(f"tilegemm.dask.run_network: the network has {len(net.inputs)} "
                         "inputs; it runs one-input networks")
    name = net.inputs[0].name
    if not isinstance(x, da.Array):
        x = np.asarray(x)
        x = da.from_array(x, chunks=(1,) + x.shape[1:])
    _known_shape(x, "tilegemm.dask.run_network")
    x = x.rechunk({axis: -1 for axis in range(1, x.ndim)})
    threads = check_threads(threads, "tilegemm.dask.run_network")
    outputs = _probe(net, name, x)
    graph_key = dask.delayed(net.graph, pure=False)
    results = {out: [] for out in outputs}
    for block, size in zip(x.to_delayed().ravel(), x.chunks[0]):
        part = dask.delayed(_network_task, pure=True)(graph_key, token, net.layout_transform,
                                                      name, block, threads)
        for out, (shape, dtype) in outputs.items():
            results[out].append(da.from_delayed(part[out], (size,) + shape, dtype=dtype))
    arrays = tuple(da.concatenate(results[out], axis=0) for out in net.outputs)
    return arrays[0] if len(arrays) == 1 else arrays
