"""The micro-kernel generator: one function emits every MR x NR kernel as LLVM vector IR.

Numba's own vectoriser turns a register tile into gathers or 256-bit code on this
class of CPU, so the kernel body is written directly with llvmlite: for each k,
NR/lanes vector loads of the packed B row, one broadcast per packed A element and
MR*(NR/lanes) ``llvm.fma`` calls into accumulators.  The accumulators live in
allocas that LLVM's mem2reg promotes to registers, so the k loop runs with no
memory traffic beyond the two packed panels.

The emitted function is a Numba ``intrinsic``::

    ukernel(kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias, bias_off, epi)

* ``a``/``b``: 1-D packed buffers; the panels start at ``a_off``/``b_off``.
  A's panel holds MR values per k, B's NR values per k (zero padded).
* ``c``: any array; the tile's first element is ``c_off`` elements from
  ``c``'s data pointer, rows are ``ldc`` elements apart, columns contiguous.
* ``C = alpha*A*B + beta*C``; ``beta == 0`` never reads C.
* ``epi`` selects the fused epilogue: ``EPI_BIAS_ROW`` adds ``bias[bias_off+i]``,
  ``EPI_BIAS_COL`` adds ``bias[bias_off+j]``, then ``EPI_RELU`` / ``EPI_RELU6``.
  The bias is read only when its flag is set (MR or NR values from ``bias_off``).
"""
import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.kernels.ir import (NUMBA_FLOAT, check_mask_width, data_ptr, epilogue, fma,
                                 load_bias, load_vector, masked_load_call, nullcontext,
                                 prefetch_line, splat, store_vector, vector_ptr)

#: k steps per iteration of the micro-kernel's main loop.
UNROLL = 4

#: Independent accumulators a k loop needs to keep the FMA units busy: FMA latency
#: (4 cycles on Zen 3 and Skylake) times FMA ports (2).  Tiles with fewer accumulators
#: (2x16 or 6x8 with 8 lanes) keep several sets, alternated by k step and added up
#: after the loop: one 2x16 set ran at half the 6x16 tile's speed.
FMA_CHAINS = 8

#: Bytes ahead of the current position that the matrix-vector dot products prefetch.


def make_microkernel(dtype, mr, nr, lanes, strided=False, edge=False, taps=False, a_step=None,
                     rows=False):
    """Build the intrinsic for an ``mr x nr`` tile of ``dtype`` with ``lanes``-wide vectors.

    Parameters
    ----------
    dtype : numpy.float32 or numpy.float64
    mr, nr : int
        Register tile; ``nr`` must be a multiple of ``lanes``.
    lanes : int
        Elements per vector register.
    strided : bool
        False: read packed panels (the signature in the module docstring).
        True: read A and B where they lie, for products small enough to skip packing::

            ukernel(kc, a, a_off, a_rs, a_cs, b, b_off, ldb, c, c_off, ldc,
                    alpha, beta, bias, bias_off, epi)

        with ``A[i, p]`` at ``a_off + i*a_rs + p*a_cs`` and row ``p`` of B's
        ``nr`` contiguous columns at ``b_off + p*ldb``.
    edge : bool
        Add two trailing arguments ``rows, cols``: only ``C[:rows, :cols]`` is read
        and written (rows skipped, columns masked), and the bias is read only
        there.  The kernel still reads full panels of A and B.
    taps : bool
        A sum of ``ntaps`` products in one tile, for convolution taps (full tiles only)::

            ukernel(kc, a, a_off, a_tap, b, b_off, ldb, taps, ntaps, masks, mask_off,
                    sched, c, c_off, ldc, alpha, beta, bias, bias_off, epi)

        adds, for each ``t < ntaps``, the packed A panel at ``a_off + t*a_tap`` times
        the ``kc`` rows of B at ``b_off + taps[t] + p*ldb`` (``nr`` contiguous columns
        each): the accumulators stay in registers across taps, C is updated once.
        ``sched`` (``ntaps + 2`` integers) masks the taps.  Where ``sched[t] >= 0``,
        the B rows of tap ``t`` are read with the ``nr`` lanes at
        ``masks[mask_off + sched[t]:]`` (an integer array of the float's width,
        each lane 0 or -1) as a load mask: lanes off read as zero and their memory
        is never touched (columns across an image row's edge, rows outside the
        image); taps with ``sched[t] < 0`` run unmasked.  The sum of the first
        ``sched[ntaps]`` taps is then ANDed with the lanes at
        ``masks[mask_off + sched[ntaps + 1]:]``: a cheaper mask for taps whose
        every read stays in memory.  Only for finite weights: zero padding times an
        infinite weight is NaN, which a masked load gives and the AND would not.
    a_step : int, optional
        Taps flavour only: A's packed panels hold ``a_step`` values per k (default
        ``mr``), so a kernel of fewer rows can run the first ``mr`` rows of panels
        packed for a taller one (the last, partial row panel of C).
    rows : bool
        A sum of ``ntaps`` products whose A rows are read in place, each from its own
        offset (channels-last convolution: row ``i`` of tap ``t`` is one output
        pixel's input pixel under that tap, its ``kc`` channels contiguous)::

            ukernel(kc, a, a_off, offs, o_off, o_step, ntaps, zeros, b, b_off, b_tap,
                    c, c_off, ldc, alpha, beta, bias, bias_off, epi)

        adds, for each ``t < ntaps``, the ``mr`` rows at ``a_off + offs[o_off +
        t*o_step + i]`` (``kc`` contiguous values each; a negative offset reads the
        first ``kc`` values of ``zeros`` instead: the padding) times the packed B
        panel at ``b_off + t*b_tap``.  With ``edge``, the two trailing arguments
        ``rows, cols`` limit C as in the other edge flavours.  With ``strided``
        (channels-first convolution), an argument ``a_cs`` after ``a_off`` says how
        far apart a row's ``kc`` values are, in the image and in ``zeros`` alike.

    Returns
    -------
    numba intrinsic, callable from jitted code only.
    """
    dtype = np.dtype(dtype).type
    if nr % lanes:
        raise ValueError(f"NR={nr} is not a multiple of the vector width {lanes}")
    nb_float = NUMBA_FLOAT[dtype]
    shape = (dtype, mr, nr, lanes)
    if taps and (strided or edge):
        raise ValueError("the taps flavour reads packed A, strided B and full tiles only")
    if rows and (taps or a_step is not None):
        raise ValueError("the rows flavour reads A in place by row offsets and packed B")
    if a_step is not None and (not taps or a_step < mr):
        raise ValueError(f"a_step={a_step} needs the taps flavour and at least mr={mr} rows")
    a_step = mr if a_step is None else a_step
    flavour = "taps" if taps else ("rows" if rows else "strided" if strided else "packed") + \
        ("_strided" if rows and strided else "") + ("_edge" if edge else "")
    if a_step != mr:
        flavour += f"_a{a_step}"       # the A stride is folded into the tile's body

    def emit(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        args = list(args)
        types_ = list(sig.args)
        valid = (args.pop(), args.pop())[::-1] if edge else None
        tap_args = row_args = None
        if taps:
            (kc, a, a_off, a_tap, b, b_off, ldb, tap_arr, ntaps, masks, mask_off, sched,
             c, c_off, ldc, alpha, beta, bias, bias_off, epi) = args
            at, bt, ct, biast = types_[1], types_[4], types_[12], types_[17]
            a_rs, a_cs = ir.Constant(intp, 1), ir.Constant(intp, a_step)
            zero = ir.Constant(intp, 0)
            tap_args = (ntaps, a_tap, data_ptr(context, builder, types_[7], tap_arr, zero),
                        data_ptr(context, builder, types_[9], masks, mask_off),
                        data_ptr(context, builder, types_[11], sched, zero))
        elif rows:
            # The strided flavour's a_cs, dropped here, is the only extra argument.
            a_cs = args.pop(3) if strided else ir.Constant(intp, 1)
            types_ = types_[:3] + types_[4:] if strided else types_
            (kc, a, a_off, offs, o_off, o_step, ntaps, zeros, b, b_off, b_tap, c, c_off, ldc,
             alpha, beta, bias, bias_off, epi) = args
            at, bt, ct, biast = types_[1], types_[8], types_[11], types_[16]
            a_rs, ldb = ir.Constant(intp, 0), ir.Constant(intp, nr)
            row_args = (ntaps, data_ptr(context, builder, types_[3], offs, o_off), o_step,
                        data_ptr(context, builder, types_[7], zeros, ir.Constant(intp, 0)), b_tap)
        elif strided:
            (kc, a, a_off, a_rs, a_cs, b, b_off, ldb, c, c_off, ldc,
             alpha, beta, bias, bias_off, epi) = args
            at, bt, ct, biast = types_[1], types_[5], types_[8], types_[13]
        else:
            kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias, bias_off, epi = args
            at, bt, ct, biast = types_[1], types_[3], types_[5], types_[10]
            # Constant panel strides let LLVM fold the addressing.
            a_rs, a_cs, ldb = ir.Constant(intp, 1), ir.Constant(intp, mr), ir.Constant(intp, nr)
        ptrs = (data_ptr(context, builder, at, a, a_off), data_ptr(context, builder, bt, b, b_off),
                data_ptr(context, builder, ct, c, c_off), data_ptr(context, builder, biast, bias, bias_off))
        _call_tile(context, builder, shape, flavour, kc, ptrs[0], a_rs, a_cs, ptrs[1], ldb,
                   ptrs[2], ldc, alpha, beta, ptrs[3], epi, valid, tap_args, row_args)
        return context.get_dummy_value()

    i = types.intp
    # Numba needs an intrinsic's parameters spelled out, so one typing function per flavour.
    if rows and strided and edge:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, a_cs, offs, o_off, o_step, ntaps, zeros, b, b_off,
                    b_tap, c, c_off, ldc, alpha, beta, bias, bias_off, epi, rows, cols):
            _check_offsets(offs, zeros, a)
            return types.void(i, a, i, i, offs, i, i, i, zeros, b, i, i, c, i, i, nb_float,
                              nb_float, bias, i, i, i, i), emit
    elif rows and strided:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, a_cs, offs, o_off, o_step, ntaps, zeros, b, b_off,
                    b_tap, c, c_off, ldc, alpha, beta, bias, bias_off, epi):
            _check_offsets(offs, zeros, a)
            return types.void(i, a, i, i, offs, i, i, i, zeros, b, i, i, c, i, i, nb_float,
                              nb_float, bias, i, i), emit
    elif rows and edge:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, offs, o_off, o_step, ntaps, zeros, b, b_off, b_tap,
                    c, c_off, ldc, alpha, beta, bias, bias_off, epi, rows, cols):
            _check_offsets(offs, zeros, a)
            return types.void(i, a, i, offs, i, i, i, zeros, b, i, i, c, i, i, nb_float,
                              nb_float, bias, i, i, i, i), emit
    elif rows:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, offs, o_off, o_step, ntaps, zeros, b, b_off, b_tap,
                    c, c_off, ldc, alpha, beta, bias, bias_off, epi):
            _check_offsets(offs, zeros, a)
            return types.void(i, a, i, offs, i, i, i, zeros, b, i, i, c, i, i, nb_float,
                              nb_float, bias, i, i), emit
    elif taps:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, a_tap, b, b_off, ldb, taps, ntaps, masks, mask_off,
                    sched, c, c_off, ldc, alpha, beta, bias, bias_off, epi):
            check_mask_width(masks, dtype)
            return types.void(i, a, i, i, b, i, i, taps, i, masks, i, sched, c, i, i,
                              nb_float, nb_float, bias, i, i), emit
    elif strided and edge:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, a_rs, a_cs, b, b_off, ldb, c, c_off, ldc,
                    alpha, beta, bias, bias_off, epi, rows, cols):
            return types.void(i, a, i, i, i, b, i, i, c, i, i, nb_float, nb_float, bias, i, i,
                              i, i), emit
    elif strided:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, a_rs, a_cs, b, b_off, ldb, c, c_off, ldc,
                    alpha, beta, bias, bias_off, epi):
            return types.void(i, a, i, i, i, b, i, i, c, i, i, nb_float, nb_float, bias, i, i), emit
    elif edge:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias,
                    bias_off, epi, rows, cols):
            return types.void(i, a, i, b, i, c, i, i, nb_float, nb_float, bias, i, i, i, i), emit
    else:
        @intrinsic
        def ukernel(typingctx, kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias,
                    bias_off, epi):
            return types.void(i, a, i, b, i, c, i, i, nb_float, nb_float, bias, i, i), emit

    ukernel.__name__ = f"{np.dtype(dtype).char}_ukernel_{mr}x{nr}_{flavour}"
    return ukernel


def _check_offsets(offs, zeros, a):
    if not (isinstance(offs, types.Array) and offs.dtype == types.intp):
        raise TypeError(f"row offsets must be an array of intp, got {offs}")
    if not (isinstance(zeros, types.Array) and zeros.dtype == a.dtype):
        raise TypeError(f"the zero row must be an array of {a.dtype}, got {zeros}")


def _call_tile(context, builder, shape, flavour, kc, a_ptr, a_rs, a_cs, b_ptr, ldb, c_ptr, ldc,
               alpha, beta, bias_ptr, epi, valid=None, taps=None, rows=None):
    """Call the tile function, defining it in this LLVM module on first use.

    One out-of-line definition per module and flavour, however many call sites a
    jitted function has: LLVM then optimises the kernel once, which keeps compile
    times down; a call per tile costs nothing next to its k loop.  Packed flavours
    pass their constant strides into the body so they fold there.
    """
    dtype, mr, nr, lanes = shape
    module = builder.module
    name = f"tilegemm_{np.dtype(dtype).name}_tile_{mr}x{nr}_{flavour}"
    args = [kc, a_ptr, a_rs, a_cs, b_ptr, ldb, c_ptr, ldc, alpha, beta, bias_ptr, epi]
    extra = {"valid": list(valid or ()), "taps": list(taps or ()), "rows": list(rows or ())}
    args += extra["valid"] + extra["taps"] + extra["rows"]
    fn = module.globals.get(name)
    if fn is None:
        fnty = ir.FunctionType(ir.VoidType(), [x.type for x in args])
        fn = ir.Function(module, fnty, name)
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        body = ir.IRBuilder(fn.append_basic_block("entry"))
        p = list(fn.args)
        if flavour.startswith("rows_strided"):
            p[2], p[5] = a_rs, ldb
        elif flavour.startswith(("packed", "rows")):
            p[2], p[3], p[5] = a_rs, a_cs, ldb
        elif flavour.startswith("taps"):
            p[2], p[3] = a_rs, a_cs
        n_valid, n_taps = len(extra["valid"]), len(extra["taps"])
        _emit_tile(context, body, shape, *p[:12], valid=tuple(p[12:12 + n_valid]) or None,
                   taps=tuple(p[12 + n_valid:12 + n_valid + n_taps]) or None,
                   rows=tuple(p[12 + n_valid + n_taps:]) or None)
        body.ret_void()
    builder.call(fn, args)


def _emit_tile(context, builder, shape, kc, a_ptr, a_rs, a_cs, b_ptr, ldb, c_ptr, ldc,
               alpha, beta, bias_ptr, epi, valid=None, taps=None, rows=None):
    """The body shared by every kernel flavour: prefetch C, the k loop, the C update.

    ``valid = (rows, cols)`` limits every access to C and the bias to that corner.
    ``taps = (ntaps, a_tap, tap_ptr, mask_ptr, sched_ptr)`` repeats the k loop once per
    tap, masked or not; ``rows = (ntaps, offs_ptr, o_step, zeros_ptr, b_tap)`` once per tap
    with A's rows at their own offsets (see make_microkernel).
    """
    dtype, mr, nr, lanes = shape
    nv = nr // lanes
    fl = context.get_value_type(NUMBA_FLOAT[dtype])
    esize = np.dtype(dtype).itemsize
    vec = ir.VectorType(fl, lanes)
    intp = context.get_value_type(types.intp)

    zero = ir.Constant(vec, [0.0] * lanes)
    # sets[s][i][v]: partial sums over the k steps with k % len(sets) == s (see FMA_CHAINS).
    n_sets = min(UNROLL, -(-FMA_CHAINS // (mr * nv)))
    sets = [[[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(mr)]
            for _ in range(n_sets)]
    acc = sets[0]

    # C is read only after the k loop: start bringing its lines in now.
    line = 64 // esize
    for i in range(mr):
        row = builder.mul(ir.Constant(intp, i), ldc)
        for j in range(0, nr, line):
            prefetch_line(builder, builder.gep(c_ptr, [builder.add(row, ir.Constant(intp, j))]))

    def k_loop(a_rows, b_ptr, b_mask=None):
        """The whole point of the kernel: ``kc`` rank-1 updates of the accumulators.

        ``a_rows``: a pointer to each row of A (its element k at ``k*a_cs``).
        ``b_mask``: pointer to one integer vector per B vector: every row of B is read
        through it by masked loads (lanes off read as zero and never touch memory).
        """

        def k_step(k, acc):
            """One rank-1 update: NR/lanes vector loads of B, MR broadcasts of A, MR*NR/lanes FMAs."""
            b_row = builder.mul(k, ldb)
            a_col = builder.mul(k, a_cs)
            if b_mask is None:
                bv = [builder.load(vector_ptr(builder, b_ptr, builder.add(b_row, ir.Constant(intp, v * lanes)),
                                               vec), align=esize) for v in range(nv)]
            else:
                # The masks are re-read from L1 every k: held in registers they would
                # take two of the 16 AVX2 registers and spill an accumulator.  The
                # empty asm hides the address from LLVM, which would otherwise hoist
                # the loads out of the loop.  Masked loads, not loads ANDed with the
                # mask: lanes off may lie outside the image's memory.
                m_ptr = builder.asm(ir.FunctionType(b_mask.type, [b_mask.type]), "", "=r,0",
                                    [b_mask], True)
                none = ir.Constant(b_mask.type.pointee, [0] * lanes)
                bv = []
                for v in range(nv):
                    m = builder.load(builder.gep(m_ptr, [ir.Constant(intp, v)]), align=esize)
                    ptr = vector_ptr(builder, b_ptr, builder.add(b_row, ir.Constant(intp, v * lanes)), vec)
                    bv.append(masked_load_call(builder, ptr, esize, builder.icmp_signed("<", m, none)))
            for i in range(mr):
                a_splat = splat(builder, builder.load(builder.gep(a_rows[i], [a_col])), vec)
                for v in range(nv):
                    builder.store(fma(builder, a_splat, bv[v], builder.load(acc[i][v])), acc[i][v])

        # Unrolled UNROLL times (fewer loop-control uops between FMAs), then the
        # remainder one k at a time.
        unroll = ir.Constant(intp, UNROLL)
        whole = builder.sdiv(kc, unroll)
        with cgutils.for_range(builder, whole) as loop:
            base = builder.mul(loop.index, unroll)
            for u in range(UNROLL):
                k_step(builder.add(base, ir.Constant(intp, u)), sets[u % n_sets])
        done = builder.mul(whole, unroll)
        with cgutils.for_range(builder, builder.sub(kc, done)) as loop:
            k_step(builder.add(done, loop.index), sets[0])

    def a_rows_at(a_ptr):
        return [builder.gep(a_ptr, [builder.mul(ir.Constant(intp, i), a_rs)]) for i in range(mr)]

    if rows is not None:
        # One k loop per tap; each row of A starts where its offset says, or at the
        # zero row for a negative offset (the tap falls in the padding).
        ntaps, offs_ptr, o_step, zeros_ptr, b_tap = rows
        with cgutils.for_range(builder, ntaps) as loop:
            t = loop.index
            at = builder.mul(t, o_step)
            a_t = []
            for i in range(mr):
                off = builder.load(builder.gep(offs_ptr, [builder.add(at, ir.Constant(intp, i))]))
                inside = builder.icmp_signed(">=", off, ir.Constant(intp, 0))
                a_t.append(builder.select(inside, builder.gep(a_ptr, [off]), zeros_ptr))
            k_loop(a_t, builder.gep(b_ptr, [builder.mul(t, b_tap)]))
    elif taps is None:
        k_loop(a_rows_at(a_ptr), b_ptr)
    else:
        # One k loop per tap, all into the same accumulators: A's panel for tap t lies
        # t*a_tap further on, B's rows start taps[t] elements from b_ptr.  Taps with
        # a load mask run a second copy of the loop, whose B loads are masked, so
        # unmasked taps pay nothing.  The taps stay in the order A is packed in: the
        # hardware prefetcher follows A as one stream (out of order measured up to
        # 30% slower).
        ntaps, a_tap, tap_ptr, mask_ptr, sched_ptr = taps
        ivec = ir.VectorType(ir.IntType(8 * esize), lanes)
        n_and = builder.load(builder.gep(sched_ptr, [ntaps]))
        and_off = builder.load(builder.gep(sched_ptr, [builder.add(ntaps, ir.Constant(ntaps.type, 1))]))
        with cgutils.for_range(builder, ntaps) as loop:
            t = loop.index
            a_t = builder.gep(a_ptr, [builder.mul(t, a_tap)])
            b_t = builder.gep(b_ptr, [builder.load(builder.gep(tap_ptr, [t]))])
            m_off = builder.load(builder.gep(sched_ptr, [t]))
            masked = builder.icmp_signed(">=", m_off, ir.Constant(m_off.type, 0))
            with builder.if_else(masked) as (then_masked, then_plain):
                with then_masked:
                    k_loop(a_rows_at(a_t), b_t,
                           builder.bitcast(builder.gep(mask_ptr, [m_off]), ivec.as_pointer()))
                with then_plain:
                    k_loop(a_rows_at(a_t), b_t)
            # The first n_and taps read unmasked (in bounds, but some lanes wrap round
            # a row's edge): their sum is masked once, here, instead of every load.
            group_done = builder.icmp_signed("==", builder.add(t, ir.Constant(t.type, 1)), n_and)
            with builder.if_then(group_done):
                keep = builder.bitcast(builder.gep(mask_ptr, [and_off]), ivec.as_pointer())
                keep = [builder.load(builder.gep(keep, [ir.Constant(intp, v)]), align=esize)
                        for v in range(nv)]
                for part in sets:
                    for i in range(mr):
                        for v in range(nv):
                            bits = builder.and_(builder.bitcast(builder.load(part[i][v]), ivec),
                                                keep[v])
                            builder.store(builder.bitcast(bits, vec), part[i][v])

    for part in sets[1:]:
        for i in range(mr):
            for v in range(nv):
                builder.store(builder.fadd(builder.load(acc[i][v]), builder.load(part[i][v])),
                              acc[i][v])

    alpha_v = splat(builder, alpha, vec)
    beta_v = splat(builder, beta, vec)
    beta_is_zero = builder.fcmp_ordered("==", beta, ir.Constant(fl, 0.0))
    zero_i = ir.Constant(epi.type, 0)

    if valid is not None:
        rows_ok = [builder.icmp_signed("<", ir.Constant(intp, i), valid[0]) for i in range(mr)]
        lane = ir.Constant(ir.VectorType(intp, lanes), list(range(lanes)))
        cols = splat(builder, valid[1], ir.VectorType(intp, lanes))
        masks = [builder.icmp_signed("<", builder.add(lane, splat(builder, ir.Constant(intp, v * lanes),
                                                                    lane.type)), cols) for v in range(nv)]
    else:
        rows_ok = masks = None

    def store_tile(read_c, fused):
        if fused:
            flags, bias_row, bias_col = load_bias(builder, epi, bias_ptr, mr, nv, vec, intp, esize,
                                                   rows_ok, masks)
        for i in range(mr):
            with (builder.if_then(rows_ok[i]) if rows_ok else nullcontext()):
                row = builder.mul(ir.Constant(intp, i), ldc)
                for v in range(nv):
                    ptr = vector_ptr(builder, c_ptr, builder.add(row, ir.Constant(intp, v * lanes)), vec)
                    r = builder.fmul(alpha_v, builder.load(acc[i][v]))
                    if read_c:
                        r = fma(builder, beta_v, load_vector(builder, ptr, esize, masks and masks[v]), r)
                    if fused:
                        r = epilogue(builder, r, flags, bias_row, bias_col, i, v)
                    store_vector(builder, r, ptr, esize, masks and masks[v])

    # Four straight-line variants so the common path carries no per-element tests.
    plain = builder.icmp_signed("==", epi, zero_i)
    with builder.if_else(beta_is_zero) as (then_zero, then_beta):
        with then_zero:
            with builder.if_else(plain) as (p, f):
                with p:
                    store_tile(False, False)
                with f:
                    store_tile(False, True)
        with then_beta:
            with builder.if_else(plain) as (p, f):
                with p:
                    store_tile(True, False)
                with f:
                    store_tile(True, True)
