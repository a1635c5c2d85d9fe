"""Packing of A/B micro-panels from any strides, and the flat views the packers read."""
import numpy as np

from tilegemm.ground.workspace import aligned_empty
from tilegemm.packing.pack import pack_a, pack_a_panel, pack_b, pack_b_panel

__all__ = ["flat_view", "aligned_empty", "pack_a", "pack_b", "pack_a_panel", "pack_b_panel"]


def flat_view(x):
    """Describe a 2-D array as ``(flat, offset, row_stride, col_stride)`` in elements.

    ``flat`` is a 1-D view of the memory ``x`` spans (no copy), ``offset`` the
    position of ``x[0, 0]`` in it.  Negative and zero strides are kept as they are.
    Strides that are not a multiple of the item size force a contiguous *copy*:
    fine for an operand that is only read, so a destination must never get here
    with such strides (``gemm_into`` routes it through a temporary first).
    """
    if x.ndim != 2:
        raise ValueError(f"flat_view needs a 2-D array, got {x.ndim}-D")
    item = x.itemsize
    if x.size == 0:
        return np.zeros(1, x.dtype), 0, 0, 0
    # Fast paths: a contiguous array is its own flat view.
    if x.flags.c_contiguous:
        return x.reshape(-1), 0, x.shape[1], 1
    if x.flags.f_contiguous:
        return x.T.reshape(-1), 0, 1, x.shape[0]
    if any(s % item for s in x.strides):
        x = np.ascontiguousarray(x)
    rs, cs = (s // item for s in x.strides)
    # Flip negatively strided axes so that base[0, 0] is the lowest address.
    base = x[:: -1 if rs < 0 else 1, :: -1 if cs < 0 else 1]
    lo = min(0, rs * (x.shape[0] - 1)) + min(0, cs * (x.shape[1] - 1))
    span = abs(rs) * (x.shape[0] - 1) + abs(cs) * (x.shape[1] - 1) + 1
    flat = np.lib.stride_tricks.as_strided(base, shape=(span,), strides=(item,),
                                           writeable=base.flags.writeable)
    return flat, -lo, rs, cs
