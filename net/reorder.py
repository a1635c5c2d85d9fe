"""Layout conversions of tensors with few channels, jitted.

Between NCHW and NHWC a tensor of C channels is, per image, a C x (H*W) matrix
transposed.  With a few channels (a network's RGB input above all) numpy's strided
copy moves one element at a time; walking one channel plane at a time instead reads
(or writes) each plane contiguously and the other side C elements apart, which
stays in the same cache lines: ResNet's and MobileNetV2's 3x224x224 input 0.45 ->
0.06 ms into NHWC (Zen 3).  From about 16 channels numpy's copy is the faster, and
:func:`tilegemm.net.layers.convert` keeps it there.
"""
import numba

from tilegemm.ground.contracts import JIT

#: Most channels the planes-at-a-time copies serve (at 8 they still beat numpy by
#: 1.5x; at 16 they lose 1.2x).
MAX_CHANNELS = 8

# Nothing allocated inside (the caller passes the output): no reference counting.
_kernel = numba.njit(**dict(JIT, _nrt=False))


@_kernel
def planes_to_pixels(x, out, n0, n1, C, HW):
    """``out[n, p, c] = x[n, c, p]`` for images ``n0 <= n < n1`` (flat arrays)."""
    for n in range(n0, n1):
        src = x[n * C * HW:(n + 1) * C * HW]
        dst = out[n * C * HW:(n + 1) * C * HW]
        for c in range(C):
            plane = src[c * HW:(c + 1) * HW]
            for p in range(HW):
                dst[p * C + c] = plane[p]


@_kernel
def pixels_to_planes(x, out, n0, n1, C, HW):
    """``out[n, c, p] = x[n, p, c]`` for images ``n0 <= n < n1`` (flat arrays)."""
    for n in range(n0, n1):
        src = x[n * C * HW:(n + 1) * C * HW]
        dst = out[n * C * HW:(n + 1) * C * HW]
        for c in range(C):
            plane = dst[c * HW:(c + 1) * HW]
            for p in range(HW):
                plane[p] = src[p * C + c]
