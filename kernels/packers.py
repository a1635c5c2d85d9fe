"""The engine's panel packer in vector IR (``packing/pack.py`` states the layouts in plain Numba)."""
import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.ground.contracts import cdiv
from tilegemm.kernels.ir import (NUMBA_FLOAT, data_ptr, esize_of, masked_load, masked_store, lane_range,
                                 prefetch_line, vector_ptr)

def make_pack_panel(dtype, panel, lanes):
    """Build the intrinsic packing one k-major micro-panel ``panel`` values wide.

    Signature (jitted code only)::

        pack_panel(kc, src, off, s_in, s_k, count, buf, dst)

    ``buf[dst + p*panel + i] = src[off + i*s_in + p*s_k]`` for ``i < count``,
    ``p < kc``; the ``panel - count`` values after them in each row are zero.  With
    ``panel = MR`` it packs an A micro-panel (``s_in``, ``s_k`` = A's row and
    column strides), with ``panel = NR`` a B micro-panel (B's column and row
    strides).  Assumes ``0 < count <= panel`` and every addressed element in range.

    Numba's own loops for this copy go through its negative-index wraparound and
    come out as gathers and scatters (docs/kernels.md has the figures); this one is
    written by hand:

    * ``s_in == 1`` (B row-major, A column-major): a row of the panel is
      ``ceil(panel/lanes)`` masked vector loads and stores, padding included;
    * ``s_k == 1`` (A row-major, B column-major): ``lanes`` values of k per vector
      load from each source row, stored as a column of the panel;
    * otherwise one scalar at a time.
    """
    dtype = np.dtype(dtype).type

    def emit(context, builder, sig, args):
        return _emit_pack_panel(context, builder, sig, args, dtype, panel, lanes)

    @intrinsic
    def pack_panel(typingctx, kc, src, off, s_in, s_k, count, buf, dst):
        i = types.intp
        return types.void(i, src, i, i, i, i, buf, i), emit

    pack_panel.__name__ = f"{np.dtype(dtype).char}_pack_panel_{panel}"
    return pack_panel


def _emit_pack_panel(context, builder, sig, args, dtype, panel, lanes):
    """The body of :func:`make_pack_panel`'s intrinsic."""
    nb_float = NUMBA_FLOAT[dtype]
    nvec = cdiv(panel, lanes)
    kc, src, off, s_in, s_k, count, buf, dst = args
    intp = context.get_value_type(types.intp)
    fl = context.get_value_type(nb_float)
    vec = ir.VectorType(fl, lanes)
    src_ptr = data_ptr(context, builder, sig.args[1], src, off)
    buf_ptr = data_ptr(context, builder, sig.args[6], buf, dst)
    one = ir.Constant(intp, 1)
    zero_i = ir.Constant(intp, 0)
    width = ir.Constant(intp, panel)

    def out_at(p, i):
        return builder.gep(buf_ptr, [builder.add(builder.mul(p, width), i)])

    with builder.if_else(builder.icmp_signed("==", s_in, one)) as (contiguous, other):
        with contiguous:
            # Loads past `count` are masked off (they read as zero: the padding);
            # stores stop at the panel's width.
            loads = [lane_range(builder, ir.Constant(intp, v * lanes), zero_i, count, lanes)
                     for v in range(nvec)]
            stores = [lane_range(builder, ir.Constant(intp, v * lanes), zero_i, width, lanes)
                      for v in range(nvec)]
            lines = cdiv(panel * np.dtype(dtype).itemsize, 64)
            with cgutils.for_range(builder, kc) as loop:
                p = loop.index
                row = builder.mul(p, s_k)
                # The next panel (``panel`` columns on) packs the same rows next:
                # ask for its lines now, the source rows lie far apart in memory.
                for q in range(lines):
                    prefetch_line(builder, builder.gep(src_ptr, [builder.add(
                        row, ir.Constant(intp, panel + q * 64 // np.dtype(dtype).itemsize))]))
                for v in range(nvec):
                    at = ir.Constant(intp, v * lanes)
                    value = masked_load(builder, src_ptr, builder.add(row, at), loads[v], vec)
                    target = builder.add(builder.mul(p, width), at)
                    if (v + 1) * lanes <= panel:
                        builder.store(value, vector_ptr(builder, buf_ptr, target, vec), align=esize_of(vec))
                    else:
                        masked_store(builder, value, buf_ptr, target, stores[v])
        with other:
            _pack_columns(builder, src_ptr, s_in, s_k, kc, count, out_at, vec, intp,
                          builder.mul(ir.Constant(intp, panel), s_in))
            # Zero the padding columns i in [count, panel).
            zero = ir.Constant(fl, 0.0)
            with cgutils.for_range(builder, kc) as loop:
                with cgutils.for_range(builder, builder.sub(width, count)) as pad:
                    builder.store(zero, out_at(loop.index, builder.add(count, pad.index)))
    return context.get_dummy_value()


def _pack_columns(builder, src_ptr, s_in, s_k, kc, count, out_at, vec, intp, ahead):
    """Columns ``i < count`` of a panel whose source is not contiguous along i (see make_pack_panel).

    ``ahead``: elements from a source row to the same row of the next panel, prefetched.
    """
    lanes = vec.count
    step = ir.Constant(intp, lanes)
    with builder.if_else(builder.icmp_signed("==", s_k, ir.Constant(intp, 1))) as (along_k, scalar):
        with along_k:
            # One vector load of `lanes` k values per source row, stored down the panel column.
            blocks = builder.sdiv(kc, step)
            with cgutils.for_range(builder, count) as col:
                i = col.index
                row_ptr = builder.gep(src_ptr, [builder.mul(i, s_in)])
                with cgutils.for_range(builder, blocks) as blk:
                    p0 = builder.mul(blk.index, step)
                    value = builder.load(vector_ptr(builder, row_ptr, p0, vec), align=esize_of(vec))
                    prefetch_line(builder, builder.gep(row_ptr, [builder.add(ahead, p0)]))
                    for l in range(lanes):
                        at = ir.Constant(intp, l)
                        builder.store(builder.extract_element(value, ir.Constant(ir.IntType(32), l)),
                                      out_at(builder.add(p0, at), i))
                done = builder.mul(blocks, step)
                with cgutils.for_range(builder, builder.sub(kc, done)) as rest:
                    p = builder.add(done, rest.index)
                    builder.store(builder.load(builder.gep(row_ptr, [p])), out_at(p, i))
        with scalar:
            with cgutils.for_range(builder, kc) as loop:
                p = loop.index
                row_ptr = builder.gep(src_ptr, [builder.mul(p, s_k)])
                with cgutils.for_range(builder, count) as col:
                    i = col.index
                    builder.store(builder.load(builder.gep(row_ptr, [builder.mul(i, s_in)])),
                                  out_at(p, i))
