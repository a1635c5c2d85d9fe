"""Winograd F(m x m, 3x3) transforms as vector IR, generated from the matrices.

One generator for every tile size m: :func:`apply_matrix` writes a matrix's adds and
FMAs over vectors (twin rows sharing their work), :func:`pick_lanes` the stride-m
lane picks, and the intrinsics below the input transform ``B^T d B`` and the output
transform ``A^T m A`` (+ bias + activation) of the convolution drivers.
"""
import collections

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from tilegemm.kernels import tilelib

from tilegemm.kernels.ir import (NUMBA_FLOAT, data_ptr, epi_flags, finish_scalar_bias, fma,
                                 lane_range, masked_load, masked_store, shuffle, splat,
                                 vector_ptr)
from tilegemm.packing.winograd import transform_matrices

# --- Winograd F(m x m, 3x3) transforms over a vector of tiles --------------------------
#
# The convolution drivers lay the transformed input out as the GEMM's packed B, one tile
# per column, so `lanes` horizontally adjacent tiles of one channel form one vector.
# Reading an NCHW image along its contiguous width, a tile row's B^T d B is then a few
# vector loads, stride-m shuffles and the matrix's adds per channel, and the output
# transform writes whole output rows: no scalar element handling anywhere.  Every load
# and store is masked, so image borders, short runs of tiles and padding need no
# special cases.  The arithmetic is generated from the matrices of
# :func:`tilegemm.packing.winograd.transform_matrices`, one generator for every tile
# size m.


def row_groups(mat):
    """Rows of ``mat`` to compute together: pairs equal up to the signs of some columns
    (the +-p point pairs of a Winograd matrix), other rows alone."""
    mat = np.asarray(mat, dtype=np.float64)
    groups, taken = [], set()
    for i, row in enumerate(mat):
        if i in taken:
            continue
        twin = next((t for t in range(i + 1, len(mat)) if t not in taken
                     and np.array_equal(np.abs(mat[t]), np.abs(row))
                     and not np.array_equal(mat[t], row)), None)
        groups.append((i,) if twin is None else (i, twin))
        taken.update(groups[-1])
    return groups


def apply_matrix(builder, mat, vecs):
    """``mat @ vecs``: row ``i`` of the result is ``sum_j mat[i][j] * vecs[j]`` (vectors).

    Zeros are skipped (their ``vecs[j]`` may be None) and +-1 are adds and
    subtractions.  Twin rows (:func:`row_groups`) share their work: ``e +- o`` with
    ``e`` the sum over the columns of equal sign and ``o`` over the others.
    """
    mat = np.asarray(mat, dtype=np.float64)
    vtype = next(v for v in vecs if v is not None).type
    elem = vtype.element
    zero = ir.Constant(vtype, [0.0] * vtype.count)

    def weighted_sum(row, cols):
        # Unit terms first: every other term is then one FMA into the sum.
        terms = sorted((j for j in cols if row[j] != 0), key=lambda j: abs(row[j]) != 1)
        acc = None
        for j in terms:
            c = row[j]
            if acc is None:
                acc = (vecs[j] if c == 1 else builder.fsub(zero, vecs[j]) if c == -1
                       else builder.fmul(splat(builder, ir.Constant(elem, c), vtype), vecs[j]))
            elif abs(c) == 1:
                acc = builder.fadd(acc, vecs[j]) if c == 1 else builder.fsub(acc, vecs[j])
            else:
                acc = fma(builder, splat(builder, ir.Constant(elem, c), vtype), vecs[j], acc)
        return zero if acc is None else acc

    out = [None] * len(mat)
    for group in row_groups(mat):
        row = mat[group[0]]
        if len(group) == 1:
            out[group[0]] = weighted_sum(row, range(len(row)))
            continue
        twin = mat[group[1]]
        e = weighted_sum(row, [j for j in range(len(row)) if twin[j] == row[j]])
        o = weighted_sum(row, [j for j in range(len(row)) if twin[j] != row[j]])
        out[group[0]], out[group[1]] = builder.fadd(e, o), builder.fsub(e, o)
    return out


def used_columns(mat, rows):
    """Columns of ``mat`` with a nonzero entry in any of ``rows``."""
    return {j for i in rows for j, c in enumerate(mat[i]) if c != 0}


def pick_lanes(builder, sources, picks):
    """A vector whose lane ``l`` is lane ``picks[l][1]`` of vector ``sources[picks[l][0]]``.

    Built from two-source shuffles over consecutive pairs of sources, merged by
    constant selects: m/2 shuffles and m/2 - 1 blends for m sources.  Sources no
    lane picks may be None.
    """
    lanes = len(picks)
    result = None
    for first in range(0, len(sources), 2):
        pair = [s for s in (first, first + 1) if s < len(sources)
                and any(src == s for src, _ in picks)]
        if not pair:
            continue
        left, right = sources[pair[0]], sources[pair[-1]]
        mine = [src in pair for src, _ in picks]
        mask = [(lanes if src != pair[0] else 0) + lane if m else 0
                for (src, lane), m in zip(picks, mine)]
        part = shuffle(builder, left, right, mask)
        if result is None:
            result = part
        else:
            keep = ir.Constant(ir.VectorType(ir.IntType(1), lanes), [int(m) for m in mine])
            result = builder.select(keep, part, result)
    return result


def inside(builder, start, offset, size):
    """i1: ``0 <= start + offset < size`` (``start``, ``size`` intp values): whether a
    pixel row or column of a tile lies in the image."""
    at = builder.add(start, ir.Constant(start.type, offset))
    return builder.and_(builder.icmp_signed(">=", at, ir.Constant(start.type, 0)),
                        builder.icmp_signed("<", at, size))


#: A transform compiled as a function of its own (by the tile helper while the caller's
#: loops compile, see ``kernels/tilelib.py``): its symbol, LLVM type and body writer.
Outlined = collections.namedtuple("Outlined", "symbol fnty body")


def _llvm_types(dtype, lanes):
    """(intp, element, vector) LLVM types of a transform over ``lanes`` of ``dtype``."""
    context = cpu_target.target_context
    elem = context.get_value_type(NUMBA_FLOAT[dtype])
    return context.get_value_type(types.intp), elem, ir.VectorType(elem, lanes)


def _calling(spec, arguments):
    """``(emit, request)`` of an intrinsic that calls the transform ``spec`` names (its
    writer in :data:`WRITERS`, then the writer's arguments), compiled once as a
    function of its own: ``emit`` writes the call, ``arguments(context, builder, sig,
    args)`` giving its values; ``request()`` asks the tile helper to compile it.

    Registered now if cached (a caller loaded from Numba's cache names it).  Not sent
    to the helper until requested: a template holds the transforms of both layouts,
    and a layer compiling the ones of the other would keep the helper from its own.
    """
    function = WRITERS[spec[0]](*spec[1:])
    tilelib.load_cached(function.symbol)

    def emit(context, builder, sig, args):
        tilelib.call(builder, function, arguments(context, builder, sig, args))
        return context.get_dummy_value()

    return emit, lambda: tilelib.prefetch(function.symbol, spec)


def input_function(dtype_name, lanes, tile):
    """The input transform of :func:`make_winograd_input` as a function of its own.

    Arguments: ``x`` (pointer to the image's element 0), ``src``, ``s_row``, ``H``,
    ``W``, ``y0``, ``col0``, ``lo``, ``hi``, ``buf`` (pointer to ``buf[dst]``), ``slab``.
    Plain values in, so that the tile helper writes the same function from the spec.
    """
    dtype = np.dtype(dtype_name).type
    intp, elem, vec = _llvm_types(dtype, lanes)
    _, _, BT = transform_matrices(tile)
    alpha = tile + 2
    # Column j of every tile: j < tile from loads at col0 + q*lanes, the last two from
    # loads shifted by one tile (col0 + tile + q*lanes): a stride-tile pick of `tile` vectors.
    columns = [(j // tile * tile, j % tile) for j in range(alpha)]
    loads = sorted({(shift, (tile * l + j) // lanes) for shift, j in columns for l in range(lanes)})
    fnty = ir.FunctionType(ir.VoidType(), [elem.as_pointer()] + [intp] * 8
                           + [elem.as_pointer(), intp])

    def body(builder, fn):
        x_ptr, src, s_row, H, W, y0, col0, lo, hi, buf_ptr, slab = fn.args
        zero_i = ir.Constant(intp, 0)
        offsets = {key: key[0] + key[1] * lanes for key in loads}
        col_masks = {key: lane_range(builder, builder.add(col0, ir.Constant(intp, o)), zero_i, W,
                                     lanes) for key, o in offsets.items()}
        row_masks = [splat(builder, inside(builder, y0, a, H), ir.VectorType(ir.IntType(1), lanes))
                     for a in range(alpha)]

        def load(a, key):
            start = builder.add(src, builder.mul(ir.Constant(intp, a), s_row))
            return masked_load(builder, x_ptr, builder.add(start, ir.Constant(intp, offsets[key])),
                               builder.and_(col_masks[key], row_masks[a]), vec)

        store_mask = lane_range(builder, zero_i, lo, hi, lanes)
        # One group of rows r of V at a time (B^T down the columns of freshly loaded
        # vectors, then the stride-tile picks and B along the rows, then the stores):
        # the stores between groups keep LLVM from hoisting every load, so the live
        # vectors fit the register file instead of spilling.
        for group in row_groups(BT):
            rows = BT[list(group)]
            used = used_columns(rows, range(len(group)))
            u = {key: apply_matrix(builder, rows, [load(a, key) if a in used else None
                                                   for a in range(alpha)])
                 for key in loads}
            for g, r in enumerate(group):
                d = [pick_lanes(builder, [u[(shift, q)][g] if (shift, q) in u else None
                                          for q in range(tile)],
                                [((tile * l + j) // lanes, (tile * l + j) % lanes)
                                 for l in range(lanes)])
                     for shift, j in columns]
                for b, value in enumerate(apply_matrix(builder, BT, d)):
                    offset = builder.mul(ir.Constant(intp, alpha * r + b), slab)
                    masked_store(builder, value, buf_ptr, offset, store_mask)
        builder.ret_void()

    return Outlined(f"tilegemm_{dtype_name}_winograd{tile}_input_l{lanes}", fnty, body)


def make_winograd_input(dtype, lanes, tile=2):
    """Build the intrinsic computing ``V = B^T d B`` of F(tile x tile, 3x3) for ``lanes``
    adjacent tiles of one channel.

    Signature (jitted code only)::

        winograd_input(x, src, (s_row, H, W), (y0, col0, lo, hi), buf, dst, slab)

    The plane ``(s_row, H, W)`` and the window ``(y0, col0, lo, hi)`` are tuples of
    intp (unpacked in the IR, at no cost).  With ``alpha = tile + 2``, tile lane ``l``
    covers input rows ``y0 .. y0+alpha-1`` and columns ``col0+tile*l .. col0+tile*l+alpha-1``
    of one channel plane with contiguous rows ``s_row`` elements apart; ``src`` is the
    offset in ``x`` of (``y0``, ``col0``), which may lie outside the plane: pixels
    outside rows ``[0, H)`` or columns ``[0, W)`` read as zero and are never loaded.
    ``V[xi]`` for lanes ``lo <= l < hi`` is stored at ``buf[dst + xi*slab + l]``
    (xi = alpha*row + column of the transformed tile); other lanes of ``buf`` are untouched.
    The transform is a function of its own (:func:`input_function`), compiled once;
    the intrinsic's ``request()`` asks the tile helper for it (:func:`_calling`).
    """
    return _input_intrinsic("winograd_input", dtype, lanes, tile, (3, 4))


def _input_intrinsic(kind, dtype, lanes, tile, sizes):
    """The intrinsic ``(x, src, plane, window, buf, dst, slab)`` of the input transform
    ``kind`` (:data:`WRITERS`), its plane and window tuples of ``sizes`` intp values."""
    def arguments(context, builder, sig, args):
        x, src, plane, window, buf, dst, slab = args
        zero = context.get_constant(types.intp, 0)
        return ([data_ptr(context, builder, sig.args[0], x, zero), src]
                + cgutils.unpack_tuple(builder, plane, sizes[0])
                + cgutils.unpack_tuple(builder, window, sizes[1])
                + [data_ptr(context, builder, sig.args[4], buf, dst), slab])

    emit, request = _calling((kind, np.dtype(dtype).name, lanes, tile), arguments)

    @intrinsic
    def input_transform(typingctx, x, src, plane, window, buf, dst, slab):
        i = types.intp
        sig = types.void(x, i, types.UniTuple(i, sizes[0]), types.UniTuple(i, sizes[1]), buf, i, i)
        return sig, emit

    input_transform.request = request
    input_transform.__name__ = f"{np.dtype(dtype).char}_{kind}{tile}_{lanes}"
    return input_transform


def output_function(dtype_name, lanes, tile):
    """The output transform of :func:`make_winograd_output` as a function of its own.

    Arguments: ``m`` (pointer to ``m[src]``), ``slab``, ``out`` (pointer to
    ``out[dst]``), ``s_row``, ``Wo``, ``col0``, ``rows``, ``lo``, ``hi``, ``bias``, ``epi``.
    """
    dtype = np.dtype(dtype_name).type
    intp, elem, vec = _llvm_types(dtype, lanes)
    AT, _, _ = transform_matrices(tile)
    alpha = tile + 2
    esize = np.dtype(dtype).itemsize
    # Output row position p (tile*lanes of them, `tile` vectors): tile lane p // tile,
    # column p % tile of that tile.
    interleave = [[(p % tile, p // tile) for p in range(q * lanes, (q + 1) * lanes)]
                  for q in range(tile)]
    fnty = ir.FunctionType(ir.VoidType(), [elem.as_pointer(), intp, elem.as_pointer()]
                           + [intp] * 6 + [elem, intp])

    def body(builder, fn):
        m_ptr, slab, out_ptr, s_row, Wo, col0, rows_left, lo, hi, bias, epi = fn.args

        def load(xi):
            return builder.load(vector_ptr(builder, m_ptr, builder.mul(ir.Constant(intp, xi), slab),
                                           vec), align=esize)

        flags = epi_flags(builder, epi)
        bias_v = splat(builder, bias, vec)
        zero_i = ir.Constant(intp, 0)
        lo_p = builder.mul(lo, ir.Constant(intp, tile))
        hi_p = builder.mul(hi, ir.Constant(intp, tile))
        # One group of output rows at a time, as in the input transform: A^T down the
        # columns of freshly loaded vectors, A along the row, then the stores.
        for group in row_groups(AT):
            rows = AT[list(group)]
            used = used_columns(rows, range(len(group)))
            cols = [apply_matrix(builder, rows, [load(alpha * a + b) if a in used else None
                                                 for a in range(alpha)])
                    for b in range(alpha)]
            for g, r in enumerate(group):
                # The activation after the lanes are put in pixel order: the residual
                # (what the output holds, EPI_ACCUMULATE) is added there, before it.
                y = [builder.select(flags["row"], builder.fadd(value, bias_v), value)
                     for value in apply_matrix(builder, AT, [cols[b][g] for b in range(alpha)])]
                row_off = builder.mul(ir.Constant(intp, r), s_row)
                with builder.if_then(builder.icmp_signed(">", rows_left, ir.Constant(intp, r))):
                    for q, picks in enumerate(interleave):
                        start = ir.Constant(intp, q * lanes)
                        mask = builder.and_(lane_range(builder, start, lo_p, hi_p, lanes),
                                            lane_range(builder, builder.add(col0, start), zero_i,
                                                       Wo, lanes))
                        at = builder.add(row_off, start)
                        held = (lambda at=at, mask=mask:
                                masked_load(builder, out_ptr, at, mask, vec))
                        value = finish_scalar_bias(builder, pick_lanes(builder, y, picks),
                                                   dict(flags, row=ir.Constant(ir.IntType(1), 0)),
                                                   bias_v, held)
                        masked_store(builder, value, out_ptr, at, mask)
        builder.ret_void()

    return Outlined(f"tilegemm_{dtype_name}_winograd{tile}_output_l{lanes}", fnty, body)


def make_winograd_output(dtype, lanes, tile=2):
    """Build the intrinsic computing ``Y = A^T m A`` + bias + activation of F(tile x tile,
    3x3) for ``lanes`` tiles.

    Signature (jitted code only)::

        winograd_output(m, src, slab, out, dst, (s_row, Wo), (col0, rows, lo, hi), bias, epi)

    The output plane ``(s_row, Wo)`` and the run ``(col0, rows, lo, hi)`` are tuples
    of intp.  ``m[src + xi*slab + l]`` is position ``xi`` of tile lane ``l``'s alpha x
    alpha product (lanes contiguous, alpha = tile + 2).  Tile lane ``l`` writes output
    columns ``col0+tile*l .. col0+tile*l+tile-1`` of the first ``rows`` output rows, the
    first at ``out[dst]`` and each ``s_row`` elements further; only lanes ``lo <= l <
    hi`` and columns ``< Wo`` are written.  ``epi``: ``EPI_BIAS_ROW`` adds the scalar
    ``bias``, then ``EPI_RELU`` / ``EPI_RELU6`` as in the GEMM epilogue (NaN stays NaN).
    The transform is a function of its own (:func:`output_function`), compiled once;
    the intrinsic's ``request()`` asks the tile helper for it (:func:`_calling`).
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]

    def arguments(context, builder, sig, args):
        m, src, slab, out, dst, plane, run, bias, epi = args
        return ([data_ptr(context, builder, sig.args[0], m, src), slab,
                 data_ptr(context, builder, sig.args[3], out, dst)]
                + cgutils.unpack_tuple(builder, plane, 2) + cgutils.unpack_tuple(builder, run, 4)
                + [bias, epi])

    emit, request = _calling(("winograd_output", np.dtype(dtype).name, lanes, tile), arguments)

    @intrinsic
    def winograd_output(typingctx, m, src, slab, out, dst, plane, run, bias, epi):
        i = types.intp
        sig = types.void(m, i, i, out, i, types.UniTuple(i, 2), types.UniTuple(i, 4), nb_float, i)
        return sig, emit

    winograd_output.request = request
    winograd_output.__name__ = f"{np.dtype(dtype).char}_winograd{tile}_output_{lanes}"
    return winograd_output


# --- NHWC: vectors over channels ------------------------------------------------------
#
# In NHWC a pixel's channels are contiguous, so `lanes` channels of one tile form one
# vector and both transforms are the matrices' adds and FMAs lane by lane: no shuffles.
# The input transform writes each tile's V[xi] as a row of channels (the GEMM's A,
# read in place by the strided micro-kernel), the output transform reads a row of
# output channels per position and writes the tile's pixels.


def _pixel_mask(builder, inside, lanes_mask):
    """``lanes_mask`` where the i1 ``inside`` holds, no lane otherwise."""
    return builder.and_(lanes_mask, splat(builder, inside, lanes_mask.type))


def input_nhwc_function(dtype_name, lanes, tile):
    """The input transform of :func:`make_winograd_input_nhwc` as a function of its own.

    Arguments: ``x`` (pointer to the image's element 0), ``src``, ``s_row``, ``s_col``,
    ``H``, ``W``, ``y0``, ``x0``, ``count``, ``buf`` (pointer to ``buf[dst]``), ``slab``.
    """
    dtype = np.dtype(dtype_name).type
    intp, elem, vec = _llvm_types(dtype, lanes)
    _, _, BT = transform_matrices(tile)
    alpha = tile + 2
    fnty = ir.FunctionType(ir.VoidType(), [elem.as_pointer()] + [intp] * 8
                           + [elem.as_pointer(), intp])

    def body(builder, fn):
        x_ptr, src, s_row, s_col, H, W, y0, x0, count, buf_ptr, slab = fn.args
        zero_i = ir.Constant(intp, 0)
        channels = lane_range(builder, zero_i, zero_i, count, lanes)
        rows_in = [inside(builder, y0, a, H) for a in range(alpha)]
        cols_in = [inside(builder, x0, b, W) for b in range(alpha)]

        def load(a, b):
            offset = builder.add(src, builder.add(builder.mul(ir.Constant(intp, a), s_row),
                                                  builder.mul(ir.Constant(intp, b), s_col)))
            mask = _pixel_mask(builder, builder.and_(rows_in[a], cols_in[b]), channels)
            return masked_load(builder, x_ptr, offset, mask, vec)

        # One group of rows r of V at a time: B^T down each column of pixels loaded for
        # it, then B along the row, then the stores (see input_function).
        for group in row_groups(BT):
            rows = BT[list(group)]
            used = used_columns(rows, range(len(group)))
            u = [apply_matrix(builder, rows, [load(a, b) if a in used else None
                                              for a in range(alpha)])
                 for b in range(alpha)]
            for g, r in enumerate(group):
                for b, value in enumerate(apply_matrix(builder, BT, [u[j][g] for j in range(alpha)])):
                    offset = builder.mul(ir.Constant(intp, alpha * r + b), slab)
                    masked_store(builder, value, buf_ptr, offset, channels)
        builder.ret_void()

    return Outlined(f"tilegemm_{dtype_name}_winograd{tile}_input_nhwc_l{lanes}", fnty, body)


def make_winograd_input_nhwc(dtype, lanes, tile):
    """Build the intrinsic computing ``V = B^T d B`` of F(tile x tile, 3x3) for ``lanes``
    channels of one NHWC tile.

    Signature (jitted code only)::

        winograd_input_nhwc(x, src, (s_row, s_col, H, W), (y0, x0, count), buf, dst, slab)

    ``src`` is the offset in ``x`` of pixel (``y0``, ``x0``) of the tile's first
    channel; pixel (y0+a, x0+b) lies ``a*s_row + b*s_col`` further, and reads as zero
    (never loaded) outside rows ``[0, H)`` and columns ``[0, W)``.  Channels
    ``0 <= c < count`` (at most ``lanes``) are transformed; ``V[xi]`` of channel ``c``
    goes to ``buf[dst + xi*slab + c]`` (xi = alpha*row + column, alpha = tile + 2).
    The transform is a function of its own (:func:`input_nhwc_function`), asked
    of the tile helper by the intrinsic's ``request()``.
    """
    return _input_intrinsic("winograd_input_nhwc", dtype, lanes, tile, (4, 3))


def output_nhwc_function(dtype_name, lanes, tile):
    """The output transform of :func:`make_winograd_output_nhwc` as a function of its own.

    Arguments: ``m`` (pointer to ``m[src]``), ``slab``, ``out`` (pointer to
    ``out[dst]``), ``s_row``, ``s_col``, ``rows``, ``cols``, ``count``, ``bias``
    (pointer to ``bias[b_off]``), ``epi``.
    """
    dtype = np.dtype(dtype_name).type
    intp, elem, vec = _llvm_types(dtype, lanes)
    AT, _, _ = transform_matrices(tile)
    alpha = tile + 2
    fnty = ir.FunctionType(ir.VoidType(), [elem.as_pointer(), intp, elem.as_pointer()]
                           + [intp] * 5 + [elem.as_pointer(), intp])

    def body(builder, fn):
        m_ptr, slab, out_ptr, s_row, s_col, rows_left, cols_left, count, bias_ptr, epi = fn.args
        zero_i = ir.Constant(intp, 0)
        channels = lane_range(builder, zero_i, zero_i, count, lanes)
        flags = epi_flags(builder, epi)
        # The bias is loaded only where the flag asks for it (an absent bias is one value).
        bias_v = masked_load(builder, bias_ptr, zero_i,
                             _pixel_mask(builder, flags["row"], channels), vec)

        def load(xi):
            return masked_load(builder, m_ptr, builder.mul(ir.Constant(intp, xi), slab),
                               channels, vec)

        for group in row_groups(AT):
            rows = AT[list(group)]
            used = used_columns(rows, range(len(group)))
            cols = [apply_matrix(builder, rows, [load(alpha * a + b) if a in used else None
                                                 for a in range(alpha)])
                    for b in range(alpha)]
            for g, r in enumerate(group):
                row_ok = builder.icmp_signed(">", rows_left, ir.Constant(intp, r))
                values = apply_matrix(builder, AT, [cols[b][g] for b in range(alpha)])
                for j, value in enumerate(values):
                    ok = builder.and_(row_ok, builder.icmp_signed(">", cols_left,
                                                                   ir.Constant(intp, j)))
                    offset = builder.add(builder.mul(ir.Constant(intp, r), s_row),
                                         builder.mul(ir.Constant(intp, j), s_col))
                    mask = _pixel_mask(builder, ok, channels)
                    held = (lambda offset=offset, mask=mask:
                            masked_load(builder, out_ptr, offset, mask, vec))
                    masked_store(builder, finish_scalar_bias(builder, value, flags, bias_v, held),
                                 out_ptr, offset, mask)
        builder.ret_void()

    return Outlined(f"tilegemm_{dtype_name}_winograd{tile}_output_nhwc_l{lanes}", fnty, body)


def make_winograd_output_nhwc(dtype, lanes, tile):
    """Build the intrinsic computing ``Y = A^T m A`` + bias + activation of F(tile x tile,
    3x3) for ``lanes`` output channels of one NHWC tile.

    Signature (jitted code only)::

        winograd_output_nhwc(m, src, slab, out, dst, (s_row, s_col), (rows, cols, count),
                             bias, b_off, epi)

    ``m[src + xi*slab + k]`` is position ``xi`` of channel ``k``'s alpha x alpha
    product.  Output pixel (r, j) of the tile, ``r < rows`` and ``j < cols``, channel
    ``k < count`` (at most ``lanes``) goes to ``out[dst + r*s_row + j*s_col + k]``;
    nothing else is written.  ``epi``: ``EPI_BIAS_ROW`` adds ``bias[b_off + k]`` (read
    only then), then ``EPI_RELU`` / ``EPI_RELU6`` as in the GEMM epilogue.  The
    transform is a function of its own (:func:`output_nhwc_function`), asked of the
    tile helper by the intrinsic's ``request()``.
    """
    def arguments(context, builder, sig, args):
        m, src, slab, out, dst, plane, window, bias, b_off, epi = args
        return ([data_ptr(context, builder, sig.args[0], m, src), slab,
                 data_ptr(context, builder, sig.args[3], out, dst)]
                + cgutils.unpack_tuple(builder, plane, 2) + cgutils.unpack_tuple(builder, window, 3)
                + [data_ptr(context, builder, sig.args[7], bias, b_off), epi])

    emit, request = _calling(("winograd_output_nhwc", np.dtype(dtype).name, lanes, tile), arguments)

    @intrinsic
    def winograd_output_nhwc(typingctx, m, src, slab, out, dst, plane, window, bias, b_off, epi):
        i = types.intp
        sig = types.void(m, i, i, out, i, types.UniTuple(i, 2), types.UniTuple(i, 3), bias, i, i)
        return sig, emit

    winograd_output_nhwc.request = request
    winograd_output_nhwc.__name__ = f"{np.dtype(dtype).char}_winograd{tile}_output_nhwc_{lanes}"
    return winograd_output_nhwc


#: Writers of the transforms as functions of their own, by the name a spec gives them
#: (the tile helper, ``kernels/tilebuild.py``, writes them from the same specs).
WRITERS = {"winograd_input": input_function, "winograd_output": output_function,
           "winograd_input_nhwc": input_nhwc_function, "winograd_output_nhwc": output_nhwc_function}
