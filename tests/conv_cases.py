"""Shared pieces of the conv2d tests: the layer tables, the float64 comparison
(:func:`run_case`), error bounds, thread settings and task-loop spies."""
import contextlib

import numba
import numpy as np
import pytest

import tilegemm
from reference import reference_conv
from tilegemm.conv import engine
from tilegemm.conv.engine import Target
from tilegemm.conv.params import conv_params


RNG = np.random.default_rng(1234)


#: Machine facts of the AVX-512 Zen 4 the routing thresholds were measured on (float32:
#: 16 lanes, 6x64 tile, 32 KiB L1d, 1 MiB L2): routing tests pass it explicitly, so
#: they check the rule, not the host.
ZEN4_AVX512 = Target(lanes=16, mr=6, nr=64, l1d_bytes=32 << 10, l2_bytes=1 << 20)


def tolerance(x, w, dtype):
    """Error bound growing with the reduction: eps * sum |x||w| over the largest window."""
    eps = np.finfo(dtype).eps
    scale = np.abs(x).max() * np.abs(w).sum(axis=(1, 2, 3)).max() if x.size and w.size else 1
    return 8 * eps * (scale + 1)


def run_case(shape, algorithm, layout, dtype=np.float32, bias=True, activation=None, path=None):
    """Compare ``conv2d`` with the reference on ``shape``; ``path`` forces a path of
    :data:`tilegemm.conv.paths.PATHS` (``algorithm`` is then ignored)."""
    (N, C, H, W), (K, kh, kw), kw_args = shape
    groups = kw_args.get("groups", 1)
    x = RNG.standard_normal((N, C, H, W)).astype(dtype)
    w = RNG.standard_normal((K, C // groups, kh, kw)).astype(dtype)
    b = RNG.standard_normal(K).astype(dtype) if bias else None
    expected = reference_conv(x, w, b, activation=activation, **reference_args(kw_args, (kh, kw)))
    xin = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    x_before, w_before = xin.copy(), w.copy()
    got = tilegemm.conv2d(xin, w, b, activation=activation, algorithm=algorithm, layout=layout,
                          _path=path, **kw_args)
    np.testing.assert_array_equal(xin, x_before)   # inputs never modified
    np.testing.assert_array_equal(w, w_before)
    if layout == "NHWC":
        got = got.transpose(0, 3, 1, 2)
    assert got.dtype == dtype
    assert got.shape == expected.shape
    err = np.abs(got - expected).max() if got.size else 0
    tol = tolerance(x, w, dtype) * WINOGRAD_GROWTH[_winograd_tile(xin, w, kw_args, layout,
                                                                  algorithm, path)]
    assert err <= tol, (f"{algorithm}/{layout}: max error {err:.3g} > {tol:.3g} "
                        f"at {np.unravel_index(np.abs(got - expected).argmax(), got.shape)}")


#: How much more F(m x m, 3x3) rounds than the other algorithms (m = 0: not Winograd):
#: the bounds docs/conv-paths.md states, F(2x2)'s taken as 1, with a margin.
WINOGRAD_GROWTH = {0: 1, 2: 1, 4: 16, 6: 32}


def _winograd_tile(x, w, kw_args, layout, algorithm, path):
    """The Winograd tile size conv2d runs for this call (0 when it runs no Winograd)."""
    plan = tilegemm.conv_plan(x.shape, w.shape, layout=layout, dtype=x.dtype, **kw_args)
    runs = path.partition(".")[0] if path else (plan.algorithm if algorithm == "auto"
                                                 else algorithm)
    return plan.winograd_tile if runs == "winograd" else 0


def reference_args(kw, kernel):
    args = {k: v for k, v in kw.items() if k in ("stride", "dilation", "groups")}
    padding = kw.get("padding", 0)
    if padding == "same":
        d = kw.get("dilation", 1)
        d = (d, d) if np.isscalar(d) else d
        pads = []
        for k, dd in zip(kernel, d):
            total = dd * (k - 1)
            pads += [total // 2, total - total // 2]
        padding = tuple(pads)
    elif padding == "valid":
        padding = 0
    args["padding"] = padding
    return args


# (input NCHW, (K, kh, kw), keyword arguments): real layers at small batch/spatial sizes ...
REAL = {
    "resnet18_conv2": ((1, 64, 9, 9), (64, 3, 3), dict(padding=1)),
    "resnet18_conv4": ((2, 256, 4, 5), (256, 3, 3), dict(padding=1)),
    "resnet18_down": ((1, 64, 9, 9), (128, 3, 3), dict(stride=2, padding=1)),
    "resnet18_stem": ((1, 3, 15, 15), (16, 7, 7), dict(stride=2, padding=3)),
    "resnet50_1x1": ((2, 256, 7, 7), (64, 1, 1), {}),
    "resnet50_1x1_s2": ((1, 128, 8, 8), (256, 1, 1), dict(stride=2)),
    "vgg_conv1": ((1, 3, 12, 12), (64, 3, 3), dict(padding=1)),
    "vgg_conv1_2": ((1, 64, 10, 10), (64, 3, 3), dict(padding=1)),
    "mobilenet_dw": ((2, 32, 10, 10), (32, 3, 3), dict(padding=1, groups=32)),
    "mobilenet_dw_s2": ((1, 64, 11, 11), (64, 3, 3), dict(stride=2, padding=1, groups=64)),
}


# ... and odd ones.
ODD = {
    "image_1x1": ((2, 5, 1, 1), (7, 1, 1), {}),
    "image_1x1_pad": ((1, 4, 1, 1), (3, 3, 3), dict(padding=1)),
    "primes": ((1, 7, 13, 11), (5, 3, 3), dict(padding=(2, 1))),
    "rect_kernel_stride": ((1, 3, 9, 14), (4, 2, 5), dict(stride=(3, 1), padding=(1, 2))),
    "dilation": ((1, 4, 12, 10), (6, 3, 3), dict(dilation=(2, 3), padding=2)),
    "groups": ((2, 12, 7, 8), (18, 3, 3), dict(groups=3, padding=1)),
    "groups_1x1": ((1, 8, 5, 5), (8, 1, 1), dict(groups=4)),
    "depthwise_multiplier": ((2, 6, 9, 21), (12, 3, 3), dict(groups=6, padding=1)),
    "depthwise_dilated_rows": ((1, 5, 11, 40), (5, 3, 5), dict(groups=5, padding=(2, 3),
                                                              dilation=(2, 1), stride=(2, 1))),
    # More pixels than any NC block and channels in several KC blocks: 1x1 packs B as a GEMM.
    "pointwise_large": ((1, 400, 3, 1100), (9, 1, 1), {}),
    "same": ((1, 3, 6, 7), (5, 4, 2), dict(padding="same")),
    "valid_wide": ((1, 2, 3, 70), (130, 3, 3), dict(padding="valid")),
    "large_stride": ((1, 3, 17, 17), (8, 3, 3), dict(stride=4)),
    # Stride 2 with few channels and many pixels: a stride-split copy of each image.
    "stride2_packed": ((1, 5, 40, 37), (6, 3, 3), dict(stride=2, padding=1)),
    "wide_tiles": ((3, 5, 6, 75), (9, 3, 3), dict(padding=1)),
    "narrow_tiles": ((5, 9, 11, 3), (13, 3, 3), dict(padding=(0, 1))),
}


CASES = {**REAL, **ODD}


def algorithms_for(shape):
    p = conv_params(*shapes_of(shape), **shape[2])
    return ["im2col", "direct", "auto"] + (["winograd"] if p.winograd_ok else [])


def shapes_of(shape):
    (N, C, H, W), (K, kh, kw), kw_args = shape
    return (N, C, H, W), (K, C // kw_args.get("groups", 1), kh, kw)


@contextlib.contextmanager
def numba_threads(n):
    """Numba's thread count set to ``n`` (capped by the machine's) for the block."""
    saved = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(saved)


def family_of(tasks):
    """The driver family (``conv/_tile_<family>.py``) whose module holds task loop ``tasks``."""
    for prefix, family in (("planes", "planes"), ("taps", "taps"), ("rows", "rows"),
                           ("im2col", "im2col"), ("winograd", "winograd")):
        if tasks.startswith(prefix):
            return family
    return "direct"


def record_arg(monkeypatch, name, index, dtype=np.float32, field=None, columns=None):
    """Wrap the ``dtype`` task loop ``name`` (in its family's module; for Winograd, in
    every tile size's and narrow kernel's; for the rows loops, in the module of the tile
    ``engine.filling_kernel`` gives layers of ``columns`` output channels a group):
    each call records its argument ``index`` in the list returned (with ``field``,
    that field of the argument, a plan's record)."""
    from tilegemm.conv import winograd
    from tilegemm.kernels.registry import registered_kernels
    family = family_of(name)
    seen = []
    if family == "winograd":
        widths = {nr for dt, _, nr, _ in registered_kernels() if dt == np.dtype(dtype)}
        modules = {engine.family_module(family, dtype, tile, columns)
                   for tile in winograd.TILES for columns in widths | {None}}
    elif family == "rows" and columns is not None:
        kernel = engine.filling_kernel(dtype, columns)
        modules = {engine.template_module(family, dtype, kernel.mr, kernel.nr, kernel.isa)}
    else:
        modules = {engine.family_module(family, dtype)}
    for mod in modules:
        monkeypatch.setattr(mod, name, _spy(getattr(mod, name), seen, index, field))
    return seen


def _spy(real, seen, index, field):
    def spy(*args):
        seen.append(args[index] if field is None else int(args[index][0][field]))
        return real(*args)
    return spy


def guarded_pages(shape, dtype):
    """An array filling whole pages, between two pages that fault on any access."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert nbytes % page == 0
    buf = mmap.mmap(-1, nbytes + 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    arr = np.frombuffer(buf, dtype, count=int(np.prod(shape)), offset=page).reshape(shape)
    for at in (addr, addr + page + nbytes):
        if libc.mprotect(at, page, 0) != 0:
            pytest.skip("mprotect is not available")
    return arr, buf
