"""Convolution geometry: validate the arguments once and describe the problem for the drivers."""
import functools
import numbers
from dataclasses import dataclass

import numpy as np

from tilegemm.ground.contracts import cdiv
from tilegemm.packing.im2col import conv_output_size

LAYOUTS = ("NCHW", "NHWC")
ACTIVATIONS = (None, "relu", "relu6")
ALGORITHMS = ("auto", "im2col", "winograd", "direct")


@dataclass(frozen=True)
class ConvParams:
    """One convolution's shapes, in NCHW terms whatever the layout.

    Padding is ``(top, bottom, left, right)``; ``padding="same"`` may make it
    asymmetric (the extra row/column goes to the bottom/right, as in torch).
    """

    N: int
    C: int
    H: int
    W: int
    K: int
    kh: int
    kw: int
    sy: int
    sx: int
    dy: int
    dx: int
    top: int
    bottom: int
    left: int
    right: int
    groups: int
    layout: str

    # Derived once per object (a frozen dataclass keeps a __dict__ for them): the
    # drivers read them many times per call.
    @functools.cached_property
    def Ho(self):
        return conv_output_size(self.H, self.kh, self.sy, self.top, self.bottom, self.dy)

    @functools.cached_property
    def Wo(self):
        return conv_output_size(self.W, self.kw, self.sx, self.left, self.right, self.dx)

    @property
    def Cg(self):
        """Input channels per group."""
        return self.C // self.groups

    @property
    def Kg(self):
        """Output channels per group."""
        return self.K // self.groups

    @functools.cached_property
    def flops(self):
        """Multiply-adds x 2 of the direct definition (the 'effective' flop count)."""
        return 2 * self.N * self.K * self.Cg * self.kh * self.kw * self.Ho * self.Wo

    @property
    def winograd_tiles(self):
        """2x2 output tiles of F(2x2, 3x3) over the batch."""
        return self.tiles_of(2)

    @property
    def winograd_flops(self):
        """Flops of Winograd's 16 GEMMs (16 products per 2x2 output tile instead of 36;
        transforms not counted)."""
        return self.winograd_flops_of(2)

    def tiles_of(self, m):
        """m x m output tiles of F(m x m, 3x3) over the batch."""
        return self.N * cdiv(self.Ho, m) * cdiv(self.Wo, m)

    def winograd_flops_of(self, m):
        """Flops of the (m+2)^2 GEMMs of F(m x m, 3x3) (transforms not counted)."""
        return 2 * (m + 2) ** 2 * self.tiles_of(m) * self.Cg * self.K

    @property
    def depthwise(self):
        return self.groups > 1 and self.Cg == 1 and self.Kg == 1

    @property
    def pointwise(self):
        """1x1, stride 1, no padding: the convolution is a plain GEMM on the image."""
        return (self.kh == self.kw == 1 and self.sy == self.sx == 1
                and self.top == self.bottom == self.left == self.right == 0)

    @property
    def winograd_ok(self):
        """F(2x2, 3x3) applies: a 3x3 kernel, stride 1, dilation 1."""
        return self.kh == self.kw == 3 and self.sy == self.sx == 1 and self.dy == self.dx == 1

    def input_shape(self):
        if self.layout == "NCHW":
            return (self.N, self.C, self.H, self.W)
        return (self.N, self.H, self.W, self.C)

    def output_shape(self):
        if self.layout == "NCHW":
            return (self.N, self.K, self.Ho, self.Wo)
        return (self.N, self.Ho, self.Wo, self.K)

    def input_strides(self):
        """Element strides ``(sn, sc, sy, sx)`` of a C-contiguous input in this layout."""
        return _strides(self.layout, self.C, self.H, self.W)

    def output_strides(self):
        """Element strides ``(sn, sk, sy, sx)`` of a C-contiguous output in this layout."""
        return _strides(self.layout, self.K, self.Ho, self.Wo)

    def geom(self):
        """``(H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx)`` for the im2col packers."""
        return (self.H, self.W, self.Ho, self.Wo, self.kh, self.kw, self.sy, self.sx,
                self.top, self.left, self.dy, self.dx)


def _strides(layout, C, H, W):
    if layout == "NCHW":
        return (C * H * W, H * W, W, 1)
    return (H * W * C, 1, W * C, C)


def _pair(value, name, func, minimum):
    """An int or a pair of ints, each >= ``minimum``, as a tuple of two ints."""
    items = value if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2:
        raise ValueError(f"{func}: {name} must be an int or a pair of ints, got {value!r}")
    out = []
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{func}: {name} must be an int or a pair of ints, got {value!r}")
        if v < minimum:
            kind = "positive" if minimum == 1 else "non-negative"
            raise ValueError(f"{func}: {name} must be {kind}, got {value!r}")
        out.append(int(v))
    return tuple(out)


def _padding(padding, kernel, stride, dilation, func):
    """``(top, bottom, left, right)`` from an int, a pair, "valid" or "same"."""
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return (0, 0, 0, 0)
        if mode == "same":
            if stride != (1, 1):
                raise ValueError(f"{func}: padding='same' is not supported for strided "
                                 f"convolutions (stride={stride}), as in torch")
            pads = []
            for k, d in zip(kernel, dilation):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return tuple(pads)
        raise ValueError(f"{func}: padding must be an int, a pair, 'same' or 'valid', "
                         f"got {padding!r}")
    py, px = _pair(padding, "padding", func, 0)
    return (py, py, px, px)


def _shape(shape, name, func):
    """A shape as a tuple of non-negative ints, with an error naming the bad entry."""
    try:
        entries = tuple(shape)
    except TypeError:
        raise TypeError(f"{func}: {name} shape must be a tuple of ints, got {shape!r}") from None
    for i, s in enumerate(entries):
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, numbers.Integral):
            raise TypeError(f"{func}: {name} shape entry {i} must be an int, got {s!r}")
        if s < 0:
            raise ValueError(f"{func}: {name} shape entry {i} is negative ({s})")
    return tuple(int(s) for s in entries)


def _plain(value):
    """Whether ``value`` is an int, a str, or a tuple of ints (exactly those types)."""
    kind = type(value)
    return kind is int or kind is str or (kind is tuple and all(type(v) is int for v in value))


def conv_params(input_shape, weight_shape, stride=1, padding=0, dilation=1, groups=1,
                layout="NCHW", func="conv2d"):
    """Validate the shapes and hyper-parameters of a convolution.

    Returns
    -------
    ConvParams
        The same object for the same plain arguments (ints, tuples of ints, strings):
        validation is cached, so a layer called again pays it once.

    Raises
    ------
    TypeError, ValueError
        Naming the argument at fault.
    """
    args = (input_shape, weight_shape, stride, padding, dilation, groups, layout, func)
    if all(_plain(a) for a in args):
        # Exact types only: True == 1 and np.int64(1) == 1 hash alike, but bools
        # must still be refused and other integer types re-checked.
        return _cached_params(*args)
    return _conv_params(*args)


@functools.lru_cache(maxsize=512)
def _cached_params(*args):
    return _conv_params(*args)


def _conv_params(input_shape, weight_shape, stride, padding, dilation, groups, layout, func):
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        raise ValueError(f"{func}: layout must be 'NCHW' or 'NHWC', got {layout!r}")
    layout = layout.upper()
    input_shape = _shape(input_shape, "input", func)
    weight_shape = _shape(weight_shape, "weight", func)
    if len(input_shape) != 4:
        raise ValueError(f"{func}: input must be 4-D ({layout}), got shape {tuple(input_shape)}")
    if len(weight_shape) != 4:
        raise ValueError(f"{func}: weight must be 4-D (K, C/groups, kh, kw), got shape "
                         f"{tuple(weight_shape)}")
    if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, numbers.Integral):
        raise TypeError(f"{func}: groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"{func}: groups must be positive, got {groups}")
    groups = int(groups)
    if layout == "NCHW":
        N, C, H, W = (int(s) for s in input_shape)
    else:
        N, H, W, C = (int(s) for s in input_shape)
    K, Cg, kh, kw = (int(s) for s in weight_shape)
    if C % groups:
        raise ValueError(f"{func}: groups={groups} does not divide the {C} input channels")
    if K % groups:
        raise ValueError(f"{func}: groups={groups} does not divide the {K} output channels "
                         f"(weight.shape[0])")
    if Cg * groups != C:
        raise ValueError(f"{func}: weight has {Cg} input channels per group but input has {C} "
                         f"channels and groups={groups} (expected weight.shape[1] == {C // groups})")
    if kh < 1 or kw < 1:
        raise ValueError(f"{func}: the kernel must be at least 1x1, got {kh}x{kw}")
    sy, sx = _pair(stride, "stride", func, 1)
    dy, dx = _pair(dilation, "dilation", func, 1)
    top, bottom, left, right = _padding(padding, (kh, kw), (sy, sx), (dy, dx), func)
    p = ConvParams(N, C, H, W, K, kh, kw, sy, sx, dy, dx, top, bottom, left, right, groups, layout)
    if p.Ho < 1 or p.Wo < 1:
        raise ValueError(f"{func}: the output would be empty ({p.Ho}x{p.Wo}): input {H}x{W} with "
                         f"padding {(top, bottom, left, right)} is smaller than the dilated "
                         f"kernel {dy * (kh - 1) + 1}x{dx * (kw - 1) + 1}")
    return p


def unique_rows(a):
    """``np.unique(a, axis=0, return_inverse=True)`` for a 2-D array, by a dict of the
    rows' bytes: numpy sorts the rows as opaque records, a tenth of a second for the
    few hundred mask rows of a 7x7 layer.  Same rows, same (byte) order."""
    a = np.ascontiguousarray(a)
    keys = [row.tobytes() for row in a]
    order = sorted(set(keys))
    index = {key: i for i, key in enumerate(order)}
    patterns = np.frombuffer(b"".join(order), a.dtype).reshape(len(order), a.shape[1])
    return patterns, np.array([index[key] for key in keys], np.intp)
