"""Direct convolution in vector IR: a channel's kernel window over output rows
(``make_direct_row``) and the depthwise kernels (rows, flat planes, NHWC blocks).

Related scalars travel as tuples of scalars (the kernel window ``(kh, kw, dy, dx)``,
an image plane, an epilogue ``(bias, epi)``), unpacked in the IR at no run-time
cost, so no intrinsic takes more than a dozen arguments.  Arrays stay arguments of
their own: a tuple holding one would take its reference count at every call.
"""
import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.kernels.ir import (FAST_EPILOGUES, NUMBA_FLOAT, by_epilogue, check_mask_width,
                                 constant_flags, data_ptr, epi_flags, epilogue, finish_scalar_bias, fma,
                                 lane_range, load_bias, masked_load, masked_load_call,
                                 masked_store, splat, vector_ptr)


def make_direct_row(dtype, lanes, to_output=False, vectors=1):
    """Build the intrinsic adding one channel's whole kernel window into ``vectors*lanes`` output pixels.

    Signature (jitted code only)::

        direct_row(x, src, (s_row, H, W), (y0, first, count), w, w_off, (kh, kw, dy, dx),
                   acc, a_off)

    For lanes ``l < count`` (at most ``vectors*lanes``): ``acc[a_off + l] += sum_{i<kh, j<kw}
    w[w_off + i*kw + j] * x[src + i*dy*s_row + j*dx + l]``, a pixel reading as 0 unless
    its row ``y0 + i*dy`` lies in ``[0, H)`` and its column ``first + j*dx + l`` in
    ``[0, W)``.  The sums stay in registers across the kernel window: one load and one
    store of ``acc`` per vector and call.  The ``vectors`` sums are independent FMA
    chains sharing each weight's broadcast: one chain alone waits on the FMA latency
    at every tap.

    With ``to_output`` the sum starts from zero and is finished in the register
    instead (one input channel per output channel: depthwise layers)::

        direct_row(x, src, (s_row, H, W), (y0, first, count), w, w_off, (kh, kw, dy, dx),
                   out, o_off, (bias, epi))

    stores ``sum + bias`` (``EPI_BIAS_ROW`` in ``epi``) through ``EPI_RELU`` /
    ``EPI_RELU6`` at ``out[o_off + l]``, lanes ``l < count``.
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        return _emit_direct_row(context, builder, sig, args, dtype, lanes, to_output, vectors)

    i = types.intp
    triple, quad = types.UniTuple(i, 3), types.UniTuple(i, 4)
    if to_output:
        @intrinsic
        def direct_row(typingctx, x, src, plane, at, w, w_off, window, out, o_off, finish):
            return types.void(x, i, triple, triple, w, i, quad, out, i,
                              types.Tuple((nb_float, i))), emit
    else:
        @intrinsic
        def direct_row(typingctx, x, src, plane, at, w, w_off, window, acc, a_off):
            return types.void(x, i, triple, triple, w, i, quad, acc, i), emit

    direct_row.__name__ = (f"{np.dtype(dtype).char}_direct_row_{lanes}x{vectors}"
                           f"{'_out' if to_output else ''}")
    return direct_row


def _emit_direct_row(context, builder, sig, args, dtype, lanes, to_output, vectors):
    """The body of :func:`make_direct_row`'s intrinsic."""
    nb_float = NUMBA_FLOAT[dtype]
    x, src, plane, at_row, w, w_off, window, acc, a_off = args[:9]
    s_row, H, W = cgutils.unpack_tuple(builder, plane, 3)
    y0, first, count = cgutils.unpack_tuple(builder, at_row, 3)
    kh, kw, dy, dx = cgutils.unpack_tuple(builder, window, 4)
    intp = context.get_value_type(types.intp)
    vec = ir.VectorType(context.get_value_type(nb_float), lanes)
    zero_i = ir.Constant(intp, 0)
    x_ptr = data_ptr(context, builder, sig.args[0], x, zero_i)
    w_ptr = data_ptr(context, builder, sig.args[4], w, w_off)
    acc_ptr = data_ptr(context, builder, sig.args[7], acc, zero_i)
    at = [ir.Constant(intp, v * lanes) for v in range(vectors)]
    wanted = [lane_range(builder, at[v], zero_i, count, lanes) for v in range(vectors)]
    totals = [cgutils.alloca_once_value(
        builder, ir.Constant(vec, [0.0] * lanes) if to_output
        else masked_load(builder, acc_ptr, builder.add(a_off, at[v]), wanted[v], vec))
        for v in range(vectors)]
    no_lanes = ir.Constant(wanted[0].type, [0] * lanes)
    with cgutils.for_range(builder, kh) as row_loop:
        i = row_loop.index
        ya = builder.add(y0, builder.mul(i, dy))
        inside = builder.and_(builder.icmp_signed(">=", ya, zero_i), builder.icmp_signed("<", ya, H))
        row_src = builder.add(src, builder.mul(builder.mul(i, dy), s_row))
        with cgutils.for_range(builder, kw) as col_loop:
            j = col_loop.index
            shift = builder.mul(j, dx)
            weight = splat(builder, builder.load(builder.gep(w_ptr, [builder.add(builder.mul(i, kw), j)])),
                            vec)
            for v in range(vectors):
                mask = builder.and_(builder.select(inside, wanted[v], no_lanes), lane_range(
                    builder, builder.add(builder.add(first, shift), at[v]), zero_i, W, lanes))
                pixels = masked_load(builder, x_ptr, builder.add(builder.add(row_src, shift), at[v]),
                                      mask, vec)
                builder.store(fma(builder, weight, pixels, builder.load(totals[v])), totals[v])
    for v in range(vectors):
        result = builder.load(totals[v])
        if to_output:
            bias, epi = cgutils.unpack_tuple(builder, args[9], 2)
            result = finish_scalar_bias(builder, result, epi_flags(builder, epi),
                                         splat(builder, bias, vec))
        masked_store(builder, result, acc_ptr, builder.add(a_off, at[v]), wanted[v])
    return context.get_dummy_value()


def make_depthwise_rows(dtype, lanes, vectors, rows):
    """Build the intrinsic computing ``rows`` output rows of one depthwise channel.

    Signature (jitted code only)::

        depthwise_rows(xp, src, (s_row, row_step), count, w, w_off, (kh, kw, dy, dx),
                       out, (o_off, o_row), (bias, epi))

    For ``r < rows`` and lanes ``l < count`` (at most ``vectors*lanes``)::

        out[o_off + r*o_row + l] = act(bias + sum_{i<kh, j<kw} w[w_off + i*kw + j]
                                       * xp[src + r*row_step + i*dy*s_row + j*dx + l])

    with the bias added when ``EPI_BIAS_ROW`` is in ``epi``, then ``EPI_RELU`` /
    ``EPI_RELU6``.  ``xp`` is a zero-padded copy of the channel with room for whole
    vectors, so the loads take no masks; only the stores are masked by ``count``.
    The ``rows*vectors`` sums are independent FMA chains sharing each weight's
    broadcast: a 3x3 window is a chain of 9 dependent FMAs per vector, so one row
    of a narrow image alone waits on the FMA latency.
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize

    def emit(context, builder, sig, args):
        xp, src, steps, count, w, w_off, window, out, o_view, finish = args
        s_row, row_step = cgutils.unpack_tuple(builder, steps, 2)
        kh, kw, dy, dx = cgutils.unpack_tuple(builder, window, 4)
        o_off, o_row = cgutils.unpack_tuple(builder, o_view, 2)
        bias, epi = cgutils.unpack_tuple(builder, finish, 2)
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        zero_i = ir.Constant(intp, 0)
        x_ptr = data_ptr(context, builder, sig.args[0], xp, zero_i)
        w_ptr = data_ptr(context, builder, sig.args[4], w, w_off)
        out_ptr = data_ptr(context, builder, sig.args[7], out, zero_i)
        at = [ir.Constant(intp, v * lanes) for v in range(vectors)]
        row_at = [builder.mul(ir.Constant(intp, r), row_step) for r in range(rows)]
        sums = [[cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes))
                 for _ in range(vectors)] for _ in range(rows)]
        with cgutils.for_range(builder, kh) as row_loop:
            i = row_loop.index
            tap_row = builder.add(src, builder.mul(builder.mul(i, dy), s_row))
            with cgutils.for_range(builder, kw) as col_loop:
                j = col_loop.index
                weight = splat(builder, builder.load(builder.gep(w_ptr, [builder.add(builder.mul(i, kw), j)])),
                                vec)
                base = builder.add(tap_row, builder.mul(j, dx))
                for r in range(rows):
                    for v in range(vectors):
                        at_rv = builder.add(builder.add(base, row_at[r]), at[v])
                        pixels = builder.load(vector_ptr(builder, x_ptr, at_rv, vec), align=esize)
                        builder.store(fma(builder, weight, pixels, builder.load(sums[r][v])), sums[r][v])
        flags = epi_flags(builder, epi)
        bias_v = splat(builder, bias, vec)
        for v in range(vectors):
            wanted = lane_range(builder, at[v], zero_i, count, lanes)
            for r in range(rows):
                result = finish_scalar_bias(builder, builder.load(sums[r][v]), flags, bias_v)
                dst = builder.add(builder.add(o_off, builder.mul(ir.Constant(intp, r), o_row)), at[v])
                masked_store(builder, result, out_ptr, dst, wanted)
        return context.get_dummy_value()

    i = types.intp

    @intrinsic
    def depthwise_rows(typingctx, xp, src, steps, count, w, w_off, window, out, o_view,
                       finish):
        return types.void(xp, i, types.UniTuple(i, 2), i, w, i, types.UniTuple(i, 4), out,
                          types.UniTuple(i, 2), types.Tuple((nb_float, i))), emit

    depthwise_rows.__name__ = f"{np.dtype(dtype).char}_depthwise_rows_{lanes}x{vectors}x{rows}"
    return depthwise_rows


def make_depthwise_flat(dtype, lanes, vectors, inside=False):
    """Build the intrinsic computing ``vectors`` output vectors of a depthwise channel
    whose output plane has the input's width, its rows end to end.

    Signature (jitted code only)::

        depthwise_flat(x, taps, ntaps, w, masks, starts, rows, out, (src, w_off, o_off),
                       (v0, nv), (bias, epi))

    For ``u < vectors``, with ``v = v0 + min(u, nv - 1)`` and ``q = starts[v]``, the
    ``lanes`` outputs at ``out[o_off + q:]`` become::

        act(bias + sum_{t < ntaps} w[w_off + t] * (x[src + q + taps[t] + l] if lane l of
                                                    tap t is on, else 0))

    (bias added when ``EPI_BIAS_ROW`` is in ``epi``, then ``EPI_RELU``/``EPI_RELU6``).
    Lane ``l`` of tap ``t`` is on where ``masks[rows[v] + taps[ntaps + t] + l]`` is -1
    (an integer array of the float's width): where the pixel lies in the image, not
    across a row's edge nor above or below it.  Those loads are masked: lanes off
    read zero and never touch memory.  Every store is whole (the caller makes the
    last vector overlap the one before); vectors past ``nv`` repeat the last one.

    ``inside=True``: vectors whose every read lies inside the channel, ``vectors``
    consecutive ones, so their offsets are constants (the general form keeps one
    register per vector's start and mask row, more than x86 has)::

        depthwise_flat(x, taps, ntaps, w, masks, out, (src, w_off, o_off), m_off, (bias, epi))

    Vector ``u`` covers ``out[o_off + u*lanes:]`` and reads ``x[src + u*lanes +
    taps[t]:]`` unmasked; lanes across a row's edge are zeroed by ANDing them with
    ``masks[m_off + taps[ntaps + t] + u*lanes:]``, unless ``taps[ntaps + t]`` is
    negative (a tap that never crosses one).

    Either way the pixel is zeroed, not the product: padding times an infinite
    weight is NaN, as in a zero-padded convolution.
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        return _emit_depthwise_flat(context, builder, sig, args, dtype, lanes, vectors, inside)

    i = types.intp
    scalar_epilogue = types.Tuple((nb_float, i))
    offsets = types.UniTuple(i, 3)        # (src, w_off, o_off): the channel in x, w, out

    if inside:
        @intrinsic
        def depthwise_flat(typingctx, x, taps, ntaps, w, masks, out, at, m_off, finish):
            check_mask_width(masks, dtype)
            return types.void(x, taps, i, w, masks, out, offsets, i, scalar_epilogue), emit
    else:
        @intrinsic
        def depthwise_flat(typingctx, x, taps, ntaps, w, masks, starts, rows, out, at, run,
                           finish):
            check_mask_width(masks, dtype)
            return types.void(x, taps, i, w, masks, starts, rows, out, offsets,
                              types.UniTuple(i, 2), scalar_epilogue), emit

    flavour = "_inside" if inside else ""
    depthwise_flat.__name__ = f"{np.dtype(dtype).char}_depthwise_flat_{lanes}x{vectors}{flavour}"
    return depthwise_flat


def _emit_depthwise_flat(context, builder, sig, args, dtype, lanes, vectors, inside):
    """The body of :func:`make_depthwise_flat`'s intrinsic."""
    nb_float = NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize
    if inside:
        x, taps, ntaps, w, masks, out, channel, m_off, finish = args
        out_type = sig.args[5]
    else:
        x, taps, ntaps, w, masks, starts, rows, out, channel, run, finish = args
        out_type = sig.args[7]
        v0, nv = cgutils.unpack_tuple(builder, run, 2)
    src, w_off, o_off = cgutils.unpack_tuple(builder, channel, 3)
    bias, epi = cgutils.unpack_tuple(builder, finish, 2)
    intp = context.get_value_type(types.intp)
    vec = ir.VectorType(context.get_value_type(nb_float), lanes)
    ivec = ir.VectorType(ir.IntType(8 * esize), lanes)
    zero_i = ir.Constant(intp, 0)
    x_ptr = data_ptr(context, builder, sig.args[0], x, src)
    tap_ptr = data_ptr(context, builder, sig.args[1], taps, zero_i)
    w_ptr = data_ptr(context, builder, sig.args[3], w, w_off)
    out_ptr = data_ptr(context, builder, out_type, out, o_off)
    if inside:
        mask_ptr = data_ptr(context, builder, sig.args[4], masks, m_off)
        at = mask_at = [ir.Constant(intp, u * lanes) for u in range(vectors)]
    else:
        mask_ptr = data_ptr(context, builder, sig.args[4], masks, zero_i)
        start_ptr = data_ptr(context, builder, sig.args[5], starts, zero_i)
        row_ptr = data_ptr(context, builder, sig.args[6], rows, zero_i)
        last = builder.sub(nv, ir.Constant(intp, 1))
        at, mask_at = [], []
        for u in range(vectors):
            step = ir.Constant(intp, u)
            v = builder.add(v0, builder.select(builder.icmp_signed("<", step, last), step, last))
            at.append(builder.load(builder.gep(start_ptr, [v])))
            mask_at.append(builder.load(builder.gep(row_ptr, [v])))
    sums = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes))
            for _ in range(vectors)]

    def add_tap(offset, weight, column=None):
        """The tap's products into the sums; ``column`` None: read unmasked."""
        for u in range(vectors):
            ptr = vector_ptr(builder, x_ptr, builder.add(offset, at[u]), vec)
            if column is None:
                pixels = builder.load(ptr, align=esize)
            else:
                on = builder.load(builder.bitcast(builder.gep(
                    mask_ptr, [builder.add(column, mask_at[u])]), ivec.as_pointer()),
                    align=esize)
                if inside:
                    pixels = builder.bitcast(builder.and_(
                        builder.bitcast(builder.load(ptr, align=esize), ivec), on), vec)
                else:
                    pixels = masked_load_call(builder, ptr, esize, builder.icmp_signed(
                        "<", on, ir.Constant(ivec, [0] * lanes)))
            builder.store(fma(builder, weight, pixels, builder.load(sums[u])), sums[u])

    with cgutils.for_range(builder, ntaps) as loop:
        t = loop.index
        offset = builder.load(builder.gep(tap_ptr, [t]))
        column = builder.load(builder.gep(tap_ptr, [builder.add(t, ntaps)]))
        weight = splat(builder, builder.load(builder.gep(w_ptr, [t])), vec)
        if inside:
            # A negative mask column: the kernel column never crosses a row's edge
            # (the centre column), so no mask to load.
            with builder.if_else(builder.icmp_signed("<", column, zero_i)) as (plain, masked):
                with plain:
                    add_tap(offset, weight)
                with masked:
                    add_tap(offset, weight, column)
        else:
            add_tap(offset, weight, column)
    flags = epi_flags(builder, epi)
    bias_v = splat(builder, bias, vec)
    for u in range(vectors):
        result = finish_scalar_bias(builder, builder.load(sums[u]), flags, bias_v)
        builder.store(result, vector_ptr(builder, out_ptr, at[u], vec), align=esize)
    return context.get_dummy_value()


def _switch_shapes(builder, index, shapes, name, emit_shape):
    """One block per entry of ``shapes``, chosen at run time by ``index`` (an IR
    integer; out of range: none), each written by ``emit_shape(shape)``."""
    done = builder.append_basic_block(f"{name}.done")
    switch = builder.switch(index, done)
    for at, shape in enumerate(shapes):
        block = builder.append_basic_block(f"{name}." + "x".join(map(str, shape)))
        switch.add_case(ir.Constant(index.type, at), block)
        builder.position_at_end(block)
        emit_shape(shape)
        builder.branch(done)
    builder.position_at_end(done)


def make_depthwise_nhwc(dtype, lanes, shapes):
    """Build the intrinsic computing a block of output pixels x channels of a depthwise
    NHWC layer, the lanes over the channels, in one of ``shapes`` ((vectors, pixels)
    pairs) chosen at run time.

    Signature (jitted code only)::

        depthwise_nhwc(shape, x, (src, pixel_step, row_step, col_step), (ni, nj),
                       w, (w_off, tap_step, kw), out, (dst, out_step), bias, b_off, epi)

    With ``(vectors, pixels) = shapes[shape]``, for ``p < pixels`` and
    ``c < vectors*lanes``::

        out[dst + p*out_step + c] = act(bias[b_off + c] + sum_{i < ni, j < nj}
            w[w_off + (i*kw + j)*tap_step + c]
            * x[src + p*pixel_step + i*row_step + j*col_step + c])

    (the bias added when ``EPI_BIAS_COL`` is in ``epi``, then ``EPI_RELU`` /
    ``EPI_RELU6``).  The caller passes only the taps inside the image, so nothing is
    masked; the ``pixels*vectors`` sums are independent FMA chains sharing each
    tap's weight vectors.  One intrinsic for every shape: a jitted helper choosing
    between several would take its arrays' reference counts on every call.
    """
    dtype = np.dtype(dtype).type

    def emit(context, builder, sig, args):
        _switch_shapes(builder, args[0], shapes, "depthwise_nhwc", lambda shape: (
            _emit_nhwc_shape(context, builder, sig, args, dtype, lanes, *shape)))
        return context.get_dummy_value()

    i = types.intp

    @intrinsic
    def depthwise_nhwc(typingctx, shape, x, x_view, window, w, w_view, out, o_view, bias, b_off,
                       epi):
        pair = types.UniTuple(i, 2)
        return types.void(i, x, types.UniTuple(i, 4), pair, w, types.UniTuple(i, 3), out, pair,
                          bias, i, i), emit

    depthwise_nhwc.__name__ = (f"{np.dtype(dtype).char}_depthwise_nhwc_{lanes}_"
                               + "_".join(f"{v}x{p}" for v, p in shapes))
    return depthwise_nhwc


def _emit_nhwc_shape(context, builder, sig, args, dtype, lanes, vectors, pixels):
    """One ``(vectors, pixels)`` case of :func:`make_depthwise_nhwc`."""
    nb_float = NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize
    _, x, x_view, window, w, w_view, out, o_view, bias, b_off, epi = args
    src, pixel_step, row_step, col_step = cgutils.unpack_tuple(builder, x_view, 4)
    ni, nj = cgutils.unpack_tuple(builder, window, 2)
    w_off, tap_step, kw = cgutils.unpack_tuple(builder, w_view, 3)
    dst, out_step = cgutils.unpack_tuple(builder, o_view, 2)
    intp = context.get_value_type(types.intp)
    vec = ir.VectorType(context.get_value_type(nb_float), lanes)
    x_ptr = data_ptr(context, builder, sig.args[1], x, src)
    w_ptr = data_ptr(context, builder, sig.args[4], w, w_off)
    out_ptr = data_ptr(context, builder, sig.args[6], out, dst)
    bias_ptr = data_ptr(context, builder, sig.args[8], bias, b_off)
    at = [builder.mul(ir.Constant(intp, p), pixel_step) for p in range(pixels)]
    sums = [[cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes))
             for _ in range(vectors)] for _ in range(pixels)]
    with cgutils.for_range(builder, ni) as row_loop:
        i = row_loop.index
        with cgutils.for_range(builder, nj) as col_loop:
            j = col_loop.index
            w_tap = builder.mul(builder.add(builder.mul(i, kw), j), tap_step)
            x_tap = builder.add(builder.mul(i, row_step), builder.mul(j, col_step))
            weights = [builder.load(vector_ptr(builder, w_ptr, builder.add(
                w_tap, ir.Constant(intp, v * lanes)), vec), align=esize)
                for v in range(vectors)]
            for p in range(pixels):
                base = builder.add(x_tap, at[p])
                for v in range(vectors):
                    pix = builder.load(vector_ptr(builder, x_ptr, builder.add(
                        base, ir.Constant(intp, v * lanes)), vec), align=esize)
                    builder.store(fma(builder, weights[v], pix, builder.load(sums[p][v])),
                                  sums[p][v])
    rows = [builder.mul(ir.Constant(intp, p), out_step) for p in range(pixels)]
    _store_sums(builder, sums, rows, epi, bias_ptr, out_ptr, vec, intp, esize)


def _store_sums(builder, sums, rows, epi, bias_ptr, out_ptr, vec, intp, esize):
    """``sums[p][v]`` through the epilogue into ``out_ptr`` at ``rows[p] + v*lanes``: the
    common epilogues (:data:`FAST_EPILOGUES`) in code of their own, the bias loaded
    once.  A depthwise output vector takes nine FMAs, so the run-time flag tests of a
    general epilogue would be a large share of its work."""
    lanes = vec.count

    def store(case):
        flags = epi_flags(builder, epi) if case is None else constant_flags(case)
        _, bias_row, bias_col = load_bias(builder, epi, bias_ptr, 1, len(sums[0]), vec, intp,
                                          esize, flags=flags)
        for p, row in enumerate(rows):
            for v, total in enumerate(sums[p]):
                result = epilogue(builder, builder.load(total), flags, bias_row, bias_col, 0, v)
                builder.store(result, vector_ptr(builder, out_ptr, builder.add(
                    row, ir.Constant(intp, v * lanes)), vec), align=esize)

    by_epilogue(builder, epi, FAST_EPILOGUES, store)


def make_depthwise_nhwc3(dtype, lanes, shapes):
    """Build the intrinsic computing ``pixels`` consecutive output pixels x ``vectors``
    vectors of channels of a depthwise NHWC layer with three kernel columns (dilation
    1), in one of ``shapes`` ((vectors, pixels, stride) triples) chosen at run time.

    Signature (jitted code only)::

        depthwise_nhwc3(shape, x, (src, row_step, C), ni, w, w_off, out, dst, bias, b_off, epi)

    With ``(vectors, pixels, stride) = shapes[shape]``, for ``p < pixels`` and ``c <
    vectors*lanes``::

        out[dst + p*C + c] = act(bias[b_off + c] + sum_{i < ni, j < 3}
            w[w_off + (3*i + j)*C + c] * x[src + i*row_step + (p*stride + j)*C + c])

    (bias when ``EPI_BIAS_COL`` is in ``epi``, then ``EPI_RELU`` / ``EPI_RELU6``).
    Neighbouring output pixels share input columns: per kernel row each of the
    ``(pixels - 1)*stride + 3`` columns is loaded once and feeds every pixel whose
    window holds it, with the row's three weight vectors kept in registers -- where a
    load per tap and pixel would leave the kernel bound by its loads.  The caller
    passes only the kernel rows inside the image (``ni`` of them, ``w_off`` at the
    first) and pixels whose columns all lie in the image row.
    """
    dtype = np.dtype(dtype).type

    def emit(context, builder, sig, args):
        _switch_shapes(builder, args[0], shapes, "depthwise_nhwc3", lambda shape: (
            _emit_nhwc3_shape(context, builder, sig, args, dtype, lanes, shape)))
        return context.get_dummy_value()

    i = types.intp

    @intrinsic
    def depthwise_nhwc3(typingctx, shape, x, x_view, ni, w, w_off, out, dst, bias, b_off, epi):
        return types.void(i, x, types.UniTuple(i, 3), i, w, i, out, i, bias, i, i), emit

    depthwise_nhwc3.__name__ = (f"{np.dtype(dtype).char}_depthwise_nhwc3_{lanes}_"
                                + "_".join(f"{v}x{p}s{s}" for v, p, s in shapes))
    return depthwise_nhwc3


def _emit_nhwc3_shape(context, builder, sig, args, dtype, lanes, shape):
    """One ``(vectors, pixels, stride)`` case of :func:`make_depthwise_nhwc3`."""
    vectors, pixels, stride = shape
    esize = np.dtype(dtype).itemsize
    _, x, x_view, ni, w, w_off, out, dst, bias, b_off, epi = args
    src, row_step, C = cgutils.unpack_tuple(builder, x_view, 3)
    intp = context.get_value_type(types.intp)
    vec = ir.VectorType(context.get_value_type(NUMBA_FLOAT[dtype]), lanes)
    x_ptr = data_ptr(context, builder, sig.args[1], x, src)
    w_ptr = data_ptr(context, builder, sig.args[4], w, w_off)
    out_ptr = data_ptr(context, builder, sig.args[6], out, dst)
    bias_ptr = data_ptr(context, builder, sig.args[8], bias, b_off)

    def const(value):
        return ir.Constant(intp, value)

    def load(ptr, at, v):
        return builder.load(vector_ptr(builder, ptr, builder.add(at, const(v * lanes)), vec),
                            align=esize)

    sums = [[cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes))
             for _ in range(vectors)] for _ in range(pixels)]
    with cgutils.for_range(builder, ni) as row_loop:
        i = row_loop.index
        w_row = builder.mul(builder.mul(i, const(3)), C)
        x_row = builder.mul(i, row_step)
        weights = [[load(w_ptr, builder.add(w_row, builder.mul(const(j), C)), v)
                    for v in range(vectors)] for j in range(3)]
        for q in range((pixels - 1) * stride + 3):
            column = [load(x_ptr, builder.add(x_row, builder.mul(const(q), C)), v)
                      for v in range(vectors)]
            for p in range(pixels):
                j = q - p * stride
                if 0 <= j < 3:
                    for v in range(vectors):
                        builder.store(fma(builder, weights[j][v], column[v],
                                          builder.load(sums[p][v])), sums[p][v])
    _store_sums(builder, sums, [builder.mul(const(p), C) for p in range(pixels)], epi, bias_ptr,
                out_ptr, vec, intp, esize)
