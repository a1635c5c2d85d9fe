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
import platform
from contextlib import nullcontext as _nullcontext

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_BIAS_ROW, EPI_RELU, EPI_RELU6

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

#: k steps per iteration of the micro-kernel's main loop.
UNROLL = 4

#: Independent accumulators a k loop needs to keep the FMA units busy: FMA latency
#: (4 cycles on Zen 3 and Skylake) times FMA ports (2).  Tiles with fewer accumulators
#: (2x16 or 6x8 with 8 lanes) keep several sets, alternated by k step and added up
#: after the loop: one 2x16 set ran at half the 6x16 tile's speed.
FMA_CHAINS = 8

#: Bytes ahead of the current position that the matrix-vector dot products prefetch.
GEMV_PREFETCH = 1024


_NUMBA_FLOAT = {np.float32: types.float32, np.float64: types.float64}


def _splat(builder, value, vec_type):
    """Broadcast a scalar into every lane."""
    undef = ir.Constant(vec_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), vec_type.count), [0] * vec_type.count)
    return builder.shuffle_vector(one, undef, mask)


def _fma(builder, a, b, c):
    """``a*b + c`` with one rounding, on vectors (llvmlite's builder.fma is scalar-only)."""
    vec = a.type
    fn = builder.module.declare_intrinsic(f"llvm.fma.{_vec_suffix(vec)}",
                                          fnty=ir.FunctionType(vec, [vec] * 3))
    return builder.call(fn, [a, b, c])


def _prefetch(builder, ptr):
    """Ask for the cache line at ``ptr`` in L1 (read, high locality)."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = builder.module.declare_intrinsic(
        "llvm.prefetch.p0", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                      ir.Constant(i32, 1)])


def _vector_ptr(builder, base, offset, vec_type):
    return builder.bitcast(builder.gep(base, [offset]), vec_type.as_pointer())


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
    nb_float = _NUMBA_FLOAT[dtype]
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
            tap_args = (ntaps, a_tap, _data(context, builder, types_[7], tap_arr, zero),
                        _data(context, builder, types_[9], masks, mask_off),
                        _data(context, builder, types_[11], sched, zero))
        elif rows:
            # The strided flavour's a_cs, dropped here, is the only extra argument.
            a_cs = args.pop(3) if strided else ir.Constant(intp, 1)
            types_ = types_[:3] + types_[4:] if strided else types_
            (kc, a, a_off, offs, o_off, o_step, ntaps, zeros, b, b_off, b_tap, c, c_off, ldc,
             alpha, beta, bias, bias_off, epi) = args
            at, bt, ct, biast = types_[1], types_[8], types_[11], types_[16]
            a_rs, ldb = ir.Constant(intp, 0), ir.Constant(intp, nr)
            row_args = (ntaps, _data(context, builder, types_[3], offs, o_off), o_step,
                        _data(context, builder, types_[7], zeros, ir.Constant(intp, 0)), b_tap)
        elif strided:
            (kc, a, a_off, a_rs, a_cs, b, b_off, ldb, c, c_off, ldc,
             alpha, beta, bias, bias_off, epi) = args
            at, bt, ct, biast = types_[1], types_[5], types_[8], types_[13]
        else:
            kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias, bias_off, epi = args
            at, bt, ct, biast = types_[1], types_[3], types_[5], types_[10]
            # Constant panel strides let LLVM fold the addressing.
            a_rs, a_cs, ldb = ir.Constant(intp, 1), ir.Constant(intp, mr), ir.Constant(intp, nr)
        ptrs = (_data(context, builder, at, a, a_off), _data(context, builder, bt, b, b_off),
                _data(context, builder, ct, c, c_off), _data(context, builder, biast, bias, bias_off))
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
            _check_mask_width(masks, dtype)
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


def _check_mask_width(masks, dtype):
    """Load masks are integers as wide as the float (typing time, a clear error)."""
    if masks.dtype.bitwidth != 8 * np.dtype(dtype).itemsize:
        raise TypeError(f"masks must be {8 * np.dtype(dtype).itemsize}-bit integers")


def _data(context, builder, array_type, array, offset):
    """Pointer to element ``offset`` of a Numba array argument."""
    return builder.gep(context.make_array(array_type)(context, builder, array).data, [offset])


@intrinsic
def next_task(typingctx, counter):
    """``counter[0]``, incremented atomically: the next task of a loop shared by threads.

    Threads that take tasks from one counter as they finish the previous ones end
    together however the machine slows one of them down, where a fixed share per
    thread waits for the slowest.
    """
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        raise TypeError("next_task needs an int64 array")

    def emit(context, builder, sig, args):
        ptr = _data(context, builder, sig.args[0], args[0], ir.Constant(ir.IntType(64), 0))
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), emit


def _element_ptr(context, builder, sig, args):
    """Pointer to ``array[index]`` for an intrinsic called as ``f(array, index, ...)``."""
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    return _data(context, builder, sig.args[0], args[0], idx)


def _check_flags(flags, index, name):
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64
            and isinstance(index, types.Integer)):
        raise TypeError(f"{name} needs an int64 array and an integer index")


@intrinsic
def publish(typingctx, flags, index, value):
    """``flags[index] = value`` after every store before it (an atomic release store).

    The thread that reads the value with :func:`acquire` then sees those stores too:
    one thread packs a panel, sets a flag, another reads the panel.
    """
    _check_flags(flags, index, "publish")

    def emit(context, builder, sig, args):
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(value, _element_ptr(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()

    return types.void(flags, index, value), emit


@intrinsic
def acquire(typingctx, flags, index):
    """``flags[index]``, read so that the stores before its :func:`publish` are seen."""
    _check_flags(flags, index, "acquire")

    def emit(context, builder, sig, args):
        return builder.load_atomic(_element_ptr(context, builder, sig, args), "acquire", 8)

    return types.int64(flags, index), emit


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 ``pause``): lets the core's other work run while a loop polls."""
    def emit(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), emit


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for the cache line holding ``array[index]``: a hint, never a fault."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        raise TypeError("prefetch needs an array and an integer index")

    def emit(context, builder, sig, args):
        _prefetch(builder, _element_ptr(context, builder, sig, args))
        return context.get_dummy_value()

    return types.void(array, index), emit


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
    fl = context.get_value_type(_NUMBA_FLOAT[dtype])
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
            _prefetch(builder, builder.gep(c_ptr, [builder.add(row, ir.Constant(intp, j))]))

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
                bv = [builder.load(_vector_ptr(builder, b_ptr, builder.add(b_row, ir.Constant(intp, v * lanes)),
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
                    ptr = _vector_ptr(builder, b_ptr, builder.add(b_row, ir.Constant(intp, v * lanes)), vec)
                    bv.append(_masked_load_call(builder, ptr, esize, builder.icmp_signed("<", m, none)))
            for i in range(mr):
                a_splat = _splat(builder, builder.load(builder.gep(a_rows[i], [a_col])), vec)
                for v in range(nv):
                    builder.store(_fma(builder, a_splat, bv[v], builder.load(acc[i][v])), acc[i][v])

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

    alpha_v = _splat(builder, alpha, vec)
    beta_v = _splat(builder, beta, vec)
    beta_is_zero = builder.fcmp_ordered("==", beta, ir.Constant(fl, 0.0))
    zero_i = ir.Constant(epi.type, 0)

    if valid is not None:
        rows_ok = [builder.icmp_signed("<", ir.Constant(intp, i), valid[0]) for i in range(mr)]
        lane = ir.Constant(ir.VectorType(intp, lanes), list(range(lanes)))
        cols = _splat(builder, valid[1], ir.VectorType(intp, lanes))
        masks = [builder.icmp_signed("<", builder.add(lane, _splat(builder, ir.Constant(intp, v * lanes),
                                                                    lane.type)), cols) for v in range(nv)]
    else:
        rows_ok = masks = None

    def store_tile(read_c, fused):
        if fused:
            flags, bias_row, bias_col = _load_bias(builder, epi, bias_ptr, mr, nv, vec, intp, esize,
                                                   rows_ok, masks)
        for i in range(mr):
            with (builder.if_then(rows_ok[i]) if rows_ok else _nullcontext()):
                row = builder.mul(ir.Constant(intp, i), ldc)
                for v in range(nv):
                    ptr = _vector_ptr(builder, c_ptr, builder.add(row, ir.Constant(intp, v * lanes)), vec)
                    r = builder.fmul(alpha_v, builder.load(acc[i][v]))
                    if read_c:
                        r = _fma(builder, beta_v, _load(builder, ptr, esize, masks and masks[v]), r)
                    if fused:
                        r = _epilogue(builder, r, flags, bias_row, bias_col, i, v)
                    _store(builder, r, ptr, esize, masks and masks[v])

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


def _epilogue(builder, r, flags, bias_row, bias_col, i, v):
    """Bias and activation on one accumulator vector, selected at run time by ``epi``."""
    # select, not fadd of a zero bias: x + 0.0 would turn -0.0 into +0.0.
    r = builder.select(flags["row"], builder.fadd(r, builder.load(bias_row[i])), r)
    r = builder.select(flags["col"], builder.fadd(r, builder.load(bias_col[v])), r)
    return _activation(builder, r, flags["relu"], flags["relu6"])


def _epi_flags(builder, epi):
    """The run-time epilogue flags of ``epi`` as i1 values: row, col, relu, relu6."""
    def flag(bit):
        return builder.icmp_signed("!=", builder.and_(epi, ir.Constant(epi.type, bit)),
                                   ir.Constant(epi.type, 0))

    return {"row": flag(EPI_BIAS_ROW), "col": flag(EPI_BIAS_COL),
            "relu": flag(EPI_RELU), "relu6": flag(EPI_RELU6)}


def _finish_scalar_bias(builder, r, flags, bias_v):
    """``r + bias_v`` when the row-bias flag is set, then the activation."""
    # select, not the add of a zero bias: r + 0.0 would turn -0.0 into +0.0.
    r = builder.select(flags["row"], builder.fadd(r, bias_v), r)
    return _activation(builder, r, flags["relu"], flags["relu6"])


def _load_bias(builder, epi, bias_ptr, mr, nv, vec, intp, esize, rows_ok=None, masks=None):
    """Read the bias into allocas, each load guarded by its flag so an absent bias is never read.

    With ``rows_ok``/``masks`` (an edge tile) only the bias of valid rows and columns is read.
    """
    lanes = vec.count
    flags = _epi_flags(builder, epi)
    zero = ir.Constant(vec, [0.0] * lanes)
    bias_row = [cgutils.alloca_once_value(builder, zero) for _ in range(mr)]
    bias_col = [cgutils.alloca_once_value(builder, zero) for _ in range(nv)]
    with builder.if_then(flags["row"]):
        for i in range(mr):
            with (builder.if_then(rows_ok[i]) if rows_ok else _nullcontext()):
                value = builder.load(builder.gep(bias_ptr, [ir.Constant(intp, i)]))
                builder.store(_splat(builder, value, vec), bias_row[i])
    with builder.if_then(flags["col"]):
        for v in range(nv):
            ptr = _vector_ptr(builder, bias_ptr, ir.Constant(intp, v * lanes), vec)
            builder.store(_load(builder, ptr, esize, masks and masks[v]), bias_col[v])
    return flags, bias_row, bias_col


def _load(builder, ptr, esize, mask=None):
    """A vector load; with ``mask``, masked lanes are not read and come back as zero.

    Below 512 bits a full mask takes a plain load (see :func:`_store`).
    """
    if mask is None:
        return builder.load(ptr, align=esize)
    vec = ptr.type.pointee
    if isinstance(mask, ir.Constant) or vec.count * esize >= 64:
        return _masked_load_call(builder, ptr, esize, mask)
    with builder.if_else(_all_set(builder, mask)) as (full, partial):
        with full:
            plain = builder.load(ptr, align=esize)
            full_block = builder.block
        with partial:
            masked = _masked_load_call(builder, ptr, esize, mask)
            partial_block = builder.block
    phi = builder.phi(vec)
    phi.add_incoming(plain, full_block)
    phi.add_incoming(masked, partial_block)
    return phi


def _masked_load_call(builder, ptr, esize, mask):
    """``llvm.masked.load`` of the vector at ``ptr``: lanes off read zero, never touching memory."""
    vec = ptr.type.pointee
    fn = builder.module.declare_intrinsic(
        f"llvm.masked.load.{_vec_suffix(vec)}.p0",
        fnty=ir.FunctionType(vec, [ptr.type, ir.IntType(32), mask.type, vec]))
    return builder.call(fn, [ptr, ir.Constant(ir.IntType(32), esize), mask,
                             ir.Constant(vec, [0.0] * vec.count)])


def _any_set(builder, mask):
    """Whether any lane of ``mask`` is set."""
    return builder.call(builder.module.declare_intrinsic(
        f"llvm.vector.reduce.or.v{mask.type.count}i1",
        fnty=ir.FunctionType(ir.IntType(1), [mask.type])), [mask])


def _all_set(builder, mask):
    """Whether every lane of ``mask`` is set (expected to be: full vectors are the common case)."""
    i1 = ir.IntType(1)
    all_set = builder.call(builder.module.declare_intrinsic(
        f"llvm.vector.reduce.and.v{mask.type.count}i1",
        fnty=ir.FunctionType(i1, [mask.type])), [mask])
    expect = builder.module.declare_intrinsic("llvm.expect.i1", fnty=ir.FunctionType(i1, [i1, i1]))
    return builder.call(expect, [all_set, ir.Constant(i1, 1)])


def _store(builder, value, ptr, esize, mask=None):
    """A vector store; with ``mask``, masked lanes of memory are left untouched.

    Below 512 bits a masked access is AVX's ``vmaskmov``, which AMD cores up to Zen 3
    run slowly (the store as microcode, tens of cycles): on a Zen 3 the Winograd
    transforms took 10 of a 20 ms layer through them.  There a full mask -- the
    common case -- takes a plain access, and only partial masks pay.
    """
    if mask is None:
        builder.store(value, ptr, align=esize)
        return
    fn = builder.module.declare_intrinsic(
        f"llvm.masked.store.{_vec_suffix(value.type)}.p0",
        fnty=ir.FunctionType(ir.VoidType(), [value.type, ptr.type, ir.IntType(32), mask.type]))
    if isinstance(mask, ir.Constant) or value.type.count * esize >= 64:
        builder.call(fn, [value, ptr, ir.Constant(ir.IntType(32), esize), mask])
        return
    with builder.if_else(_all_set(builder, mask)) as (full, partial):
        with full:
            builder.store(value, ptr, align=esize)
        with partial:
            with builder.if_then(_any_set(builder, mask)):
                builder.call(fn, [value, ptr, ir.Constant(ir.IntType(32), esize), mask])


def _vec_suffix(vec):
    """LLVM's overload suffix for a float vector type, e.g. ``v16f32``."""
    return f"v{vec.count}{'f32' if isinstance(vec.element, ir.FloatType) else 'f64'}"


def _esize(vec):
    return 4 if isinstance(vec.element, ir.FloatType) else 8


# --- Winograd F(2x2, 3x3) transforms over a vector of tiles ----------------------------
#
# The convolution drivers lay the transformed input out as the GEMM's packed B, one tile
# per column, so `lanes` horizontally adjacent tiles of one channel form one vector.
# Reading an NCHW image along its contiguous width, a tile row's B^T d B is then a few
# vector loads, adds and even/odd shuffles per channel, and the output transform writes
# whole output rows: no scalar element handling anywhere.  Every load and store is
# masked, so image borders, short runs of tiles and padding need no special cases.


def _masked_load(builder, base, offset, mask, vec):
    """``vec`` from ``base[offset:]`` where ``mask`` is set, zero elsewhere (masked lanes never touch memory)."""
    return _load(builder, _vector_ptr(builder, base, offset, vec), _esize(vec), mask)


def _masked_store(builder, value, base, offset, mask):
    """Store the lanes of ``value`` selected by ``mask`` at ``base[offset:]``; the others are untouched."""
    _store(builder, value, _vector_ptr(builder, base, offset, value.type), _esize(value.type), mask)


def _lane_range(builder, first, lo, hi, count):
    """Mask of the lanes ``l`` with ``lo <= first + l < hi`` (i32 arithmetic)."""
    i32 = ir.IntType(32)
    ivec = ir.VectorType(i32, count)
    pos = builder.add(_splat(builder, builder.trunc(first, i32), ivec),
                      ir.Constant(ivec, list(range(count))))
    return builder.and_(builder.icmp_signed(">=", pos, _splat(builder, builder.trunc(lo, i32), ivec)),
                        builder.icmp_signed("<", pos, _splat(builder, builder.trunc(hi, i32), ivec)))


def _activation(builder, r, relu, relu6):
    """relu (``relu`` or ``relu6`` set) then the clip at 6 (``relu6``), chosen at run time."""
    vec = r.type
    zero_v = ir.Constant(vec, [0.0] * vec.count)
    six_v = ir.Constant(vec, [6.0] * vec.count)
    # Compare-and-select keeps NaN (NaN < 0 is false), unlike llvm.maxnum.
    clipped = builder.select(builder.fcmp_ordered("<", r, zero_v), zero_v, r)
    r = builder.select(builder.or_(relu, relu6), clipped, r)
    r6 = builder.select(builder.fcmp_ordered(">", r, six_v), six_v, r)
    return builder.select(relu6, r6, r)


def _shuffle(builder, a, b, indices):
    mask = ir.Constant(ir.VectorType(ir.IntType(32), len(indices)), list(indices))
    return builder.shuffle_vector(a, b, mask)


def make_winograd_input(dtype, lanes):
    """Build the intrinsic computing ``V = B^T d B`` for ``lanes`` adjacent tiles of one channel.

    Signature (jitted code only)::

        winograd_input(x, src, s_row, y0, H, col0, W, lo, hi, buf, dst, slab)

    Tile lane ``l`` covers input rows ``y0 .. y0+3`` and columns ``col0+2l .. col0+2l+3``
    of one channel plane with contiguous rows ``s_row`` elements apart; ``src`` is the
    offset in ``x`` of (``y0``, ``col0``), which may lie outside the plane: pixels
    outside rows ``[0, H)`` or columns ``[0, W)`` read as zero and are never loaded.
    ``V[xi]`` for lanes ``lo <= l < hi`` is stored at ``buf[dst + xi*slab + l]``
    (xi = 4*row + column of the 4x4 transformed tile); other lanes of ``buf`` are untouched.
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        x, src, s_row, y0, H, col0, W, lo, hi, buf, dst, slab = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        x_ptr = _data(context, builder, sig.args[0], x, ir.Constant(intp, 0))
        buf_ptr = _data(context, builder, sig.args[9], buf, dst)
        zero_i = ir.Constant(intp, 0)
        # Four loads per input row: columns col0+[0, 2*lanes) and col0+2+[0, 2*lanes).
        offsets = (0, lanes, 2, lanes + 2)
        col_masks = [_lane_range(builder, builder.add(col0, ir.Constant(intp, o)), zero_i, W, lanes)
                     for o in offsets]
        rows = []
        for a in range(4):
            ya = builder.add(y0, ir.Constant(intp, a))
            inside = builder.and_(builder.icmp_signed(">=", ya, zero_i),
                                  builder.icmp_signed("<", ya, H))
            row_mask = _splat(builder, inside, ir.VectorType(ir.IntType(1), lanes))
            start = builder.add(src, builder.mul(ir.Constant(intp, a), s_row))
            rows.append([_masked_load(builder, x_ptr, builder.add(start, ir.Constant(intp, o)),
                                      builder.and_(m, row_mask), vec)
                         for o, m in zip(offsets, col_masks)])
        # B^T down the columns: t = (d0 - d2, d1 + d2, d2 - d1, d1 - d3), per loaded vector.
        d0, d1, d2, d3 = rows
        t = [[builder.fsub(d0[i], d2[i]) for i in range(4)],
             [builder.fadd(d1[i], d2[i]) for i in range(4)],
             [builder.fsub(d2[i], d1[i]) for i in range(4)],
             [builder.fsub(d1[i], d3[i]) for i in range(4)]]
        even = list(range(0, 2 * lanes, 2))
        odd = list(range(1, 2 * lanes, 2))
        store_mask = _lane_range(builder, zero_i, lo, hi, lanes)
        for r in range(4):
            # Column b of every tile: b = 0, 1 from the loads at col0, b = 2, 3 from col0 + 2.
            e0 = _shuffle(builder, t[r][0], t[r][1], even)
            e1 = _shuffle(builder, t[r][0], t[r][1], odd)
            e2 = _shuffle(builder, t[r][2], t[r][3], even)
            e3 = _shuffle(builder, t[r][2], t[r][3], odd)
            # ... then B along the row.
            v = (builder.fsub(e0, e2), builder.fadd(e1, e2), builder.fsub(e2, e1),
                 builder.fsub(e1, e3))
            for b in range(4):
                offset = builder.mul(ir.Constant(intp, 4 * r + b), slab)
                _masked_store(builder, v[b], buf_ptr, offset, store_mask)
        return context.get_dummy_value()

    @intrinsic
    def winograd_input(typingctx, x, src, s_row, y0, H, col0, W, lo, hi, buf, dst, slab):
        i = types.intp
        sig = types.void(x, i, i, i, i, i, i, i, i, buf, i, i)
        return sig, emit

    winograd_input.__name__ = f"{np.dtype(dtype).char}_winograd_input_{lanes}"
    return winograd_input


def make_winograd_output(dtype, lanes):
    """Build the intrinsic computing ``Y = A^T m A`` + bias + activation for ``lanes`` tiles.

    Signature (jitted code only)::

        winograd_output(m, src, slab, out, dst, s_row, col0, Wo, rows, lo, hi, bias, epi)

    ``m[src + xi*slab + l]`` is position ``xi`` of tile lane ``l``'s 4x4 product
    (lanes contiguous).  Tile lane ``l`` writes output columns ``col0+2l`` and
    ``col0+2l+1`` of the row at ``out[dst]`` and, when ``rows == 2``, of the next row
    ``s_row`` elements further; only lanes ``lo <= l < hi`` and columns ``< Wo`` are
    written.  ``epi``: ``EPI_BIAS_ROW`` adds the scalar ``bias``, then ``EPI_RELU`` /
    ``EPI_RELU6`` as in the GEMM epilogue (NaN stays NaN).
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        m, src, slab, out, dst, s_row, col0, Wo, rows, lo, hi, bias, epi = args
        intp = context.get_value_type(types.intp)
        fl = context.get_value_type(nb_float)
        vec = ir.VectorType(fl, lanes)
        esize = np.dtype(dtype).itemsize
        m_ptr = _data(context, builder, sig.args[0], m, src)
        out_ptr = _data(context, builder, sig.args[3], out, dst)
        v = [builder.load(_vector_ptr(builder, m_ptr, builder.mul(ir.Constant(intp, xi), slab), vec),
                          align=esize) for xi in range(16)]
        # A^T m: rows 0+1+2 and 1-2-3 of each 4x4 block, then the same along the columns.
        a = [builder.fadd(builder.fadd(v[j], v[4 + j]), v[8 + j]) for j in range(4)]
        b = [builder.fsub(builder.fsub(v[4 + j], v[8 + j]), v[12 + j]) for j in range(4)]

        def combine(r):
            return (builder.fadd(builder.fadd(r[0], r[1]), r[2]),
                    builder.fsub(builder.fsub(r[1], r[2]), r[3]))

        flags = _epi_flags(builder, epi)
        bias_v = _splat(builder, bias, vec)

        def finish(y):
            return _finish_scalar_bias(builder, y, flags, bias_v)

        zero_i = ir.Constant(intp, 0)
        first = list(range(lanes // 2))
        for r, row in enumerate((combine(a), combine(b))):
            y0, y1 = finish(row[0]), finish(row[1])
            # Interleave the two output columns of every tile into one row of 2*lanes values.
            halves = (_shuffle(builder, y0, y1, [i for l in first for i in (l, lanes + l)]),
                      _shuffle(builder, y0, y1, [i for l in first for i in (lanes // 2 + l,
                                                                           lanes + lanes // 2 + l)]))
            row_off = zero_i if r == 0 else s_row
            wanted = builder.icmp_signed(">", rows, ir.Constant(intp, r))
            with builder.if_then(wanted):
                for h, half in enumerate(halves):
                    start = ir.Constant(intp, h * lanes)
                    # Position q of this half is output column col0 + start + q, tile lane (start+q)//2.
                    mask = builder.and_(
                        _lane_range(builder, start, builder.mul(lo, ir.Constant(intp, 2)),
                                    builder.mul(hi, ir.Constant(intp, 2)), lanes),
                        _lane_range(builder, builder.add(col0, start), zero_i, Wo, lanes))
                    _masked_store(builder, half, out_ptr, builder.add(row_off, start), mask)
        return context.get_dummy_value()

    @intrinsic
    def winograd_output(typingctx, m, src, slab, out, dst, s_row, col0, Wo, rows, lo, hi, bias,
                        epi):
        i = types.intp
        sig = types.void(m, i, i, out, i, i, i, i, i, i, i, nb_float, i)
        return sig, emit

    winograd_output.__name__ = f"{np.dtype(dtype).char}_winograd_output_{lanes}"
    return winograd_output


def make_masked_copy(dtype, lanes, step=1):
    """Build the intrinsic copying up to ``lanes`` elements of an image row, zeros off the row.

    Signature (jitted code only)::

        masked_copy(x, src, first, W, buf, dst, count)

    For lanes ``l < count``: ``buf[dst + l] = x[src + l*step]`` when ``0 <= first + l*step
    < W`` (``first`` is the column of ``x[src]`` in its row of ``W`` pixels), else 0.
    Pixels off the row are never loaded and ``buf`` past ``count`` is untouched: the
    implicit im2col packer's stride-1 row segments, padding included, in one vector
    each.  ``step`` is 1 or 2 (two loads and an even-lane shuffle: a stride-2 row).
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]
    if step not in (1, 2):
        raise ValueError(f"masked_copy reads every pixel or every other one, not step={step}")

    def emit(context, builder, sig, args):
        x, src, first, W, buf, dst, count = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        zero_i = ir.Constant(intp, 0)
        x_ptr = _data(context, builder, sig.args[0], x, zero_i)
        wanted = _lane_range(builder, zero_i, zero_i, count, lanes)
        if step == 1:
            inside = builder.and_(wanted, _lane_range(builder, first, zero_i, W, lanes))
            value = _masked_load(builder, x_ptr, src, inside, vec)
        else:
            # Source elements j < 2*count - 1 of the row, in two vectors; keep the even ones.
            needed = builder.sub(builder.mul(count, ir.Constant(intp, 2)), ir.Constant(intp, 1))
            halves = []
            for h in range(2):
                at = ir.Constant(intp, h * lanes)
                mask = builder.and_(_lane_range(builder, at, zero_i, needed, lanes),
                                    _lane_range(builder, builder.add(first, at), zero_i, W, lanes))
                halves.append(_masked_load(builder, x_ptr, builder.add(src, at), mask, vec))
            value = _shuffle(builder, halves[0], halves[1], list(range(0, 2 * lanes, 2)))
        _masked_store(builder, value, _data(context, builder, sig.args[4], buf, zero_i), dst,
                      wanted)
        return context.get_dummy_value()

    @intrinsic
    def masked_copy(typingctx, x, src, first, W, buf, dst, count):
        i = types.intp
        return types.void(x, i, i, i, buf, i, i), emit

    masked_copy.__name__ = f"{np.dtype(dtype).char}_masked_copy_{lanes}"
    return masked_copy


def make_transpose(dtype, lanes):
    """Build the intrinsic transposing a ``lanes x lanes`` block between two arrays.

    Signature (jitted code only)::

        transpose(x, src, src_step, y, dst, dst_step)

    For ``i, j < lanes``: ``y[dst + j*dst_step + i] = x[src + i*src_step + j]``.  The
    rows are loaded as vectors and transposed in registers by ``log2(lanes)`` rounds of
    block swaps (round ``d`` swaps the ``d``-lane blocks off the diagonal of each
    ``2d x 2d`` block), then stored as vectors: no strided element copies.
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize
    if lanes & (lanes - 1):
        raise ValueError(f"transpose needs a power-of-two vector width, got {lanes}")

    def emit(context, builder, sig, args):
        x, src, src_step, y, dst, dst_step = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        x_ptr = _data(context, builder, sig.args[0], x, src)
        y_ptr = _data(context, builder, sig.args[3], y, dst)
        rows = [builder.load(_vector_ptr(builder, x_ptr, builder.mul(ir.Constant(intp, i),
                                                                      src_step), vec),
                             align=esize)
                for i in range(lanes)]
        d = lanes // 2
        while d:
            for r in range(lanes):
                if r & d:
                    continue
                a, b = rows[r], rows[r + d]
                rows[r] = _shuffle(builder, a, b, [p if not p & d else lanes + p - d
                                                   for p in range(lanes)])
                rows[r + d] = _shuffle(builder, a, b, [p + d if not p & d else lanes + p
                                                       for p in range(lanes)])
            d //= 2
        for j in range(lanes):
            builder.store(rows[j], _vector_ptr(builder, y_ptr, builder.mul(ir.Constant(intp, j),
                                                                           dst_step), vec),
                          align=esize)
        return context.get_dummy_value()

    @intrinsic
    def transpose(typingctx, x, src, src_step, y, dst, dst_step):
        i = types.intp
        return types.void(x, i, i, y, i, i), emit

    transpose.__name__ = f"{np.dtype(dtype).char}_transpose_{lanes}"
    return transpose


def make_deinterleave(dtype, lanes):
    """Build the intrinsic splitting ``2*lanes`` consecutive elements into even and odd.

    Signature (jitted code only)::

        deinterleave(x, src, y, even, odd)

    For ``l < lanes``: ``y[even + l] = x[src + 2*l]`` and ``y[odd + l] = x[src + 2*l + 1]``:
    two plain loads, two shuffles, two plain stores.  A stride-2 row's two column
    phases in one pass, where a masked copy per phase read the row twice.
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize

    def emit(context, builder, sig, args):
        x, src, y, even, odd = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        x_ptr = _data(context, builder, sig.args[0], x, src)
        y_ptr = _data(context, builder, sig.args[2], y, ir.Constant(intp, 0))
        lo = builder.load(_vector_ptr(builder, x_ptr, ir.Constant(intp, 0), vec), align=esize)
        hi = builder.load(_vector_ptr(builder, x_ptr, ir.Constant(intp, lanes), vec), align=esize)
        for start, at in ((0, even), (1, odd)):
            builder.store(_shuffle(builder, lo, hi, list(range(start, 2 * lanes, 2))),
                          _vector_ptr(builder, y_ptr, at, vec), align=esize)
        return context.get_dummy_value()

    @intrinsic
    def deinterleave(typingctx, x, src, y, even, odd):
        i = types.intp
        return types.void(x, i, y, i, i), emit

    deinterleave.__name__ = f"{np.dtype(dtype).char}_deinterleave_{lanes}"
    return deinterleave


def _reduce_add(builder, vec_value):
    """Sum of a vector's lanes as a tree of halvings: log2(lanes) dependent adds, not lanes."""
    i32 = ir.IntType(32)
    while vec_value.type.count > 1:
        half = vec_value.type.count // 2
        undef = ir.Constant(vec_value.type, ir.Undefined)
        lo = builder.shuffle_vector(vec_value, undef, ir.Constant(ir.VectorType(i32, half), list(range(half))))
        hi = builder.shuffle_vector(vec_value, undef,
                                    ir.Constant(ir.VectorType(i32, half), list(range(half, 2 * half))))
        vec_value = builder.fadd(lo, hi)
    return builder.extract_element(vec_value, ir.Constant(i32, 0))


def make_gemv_kernels(dtype, lanes, rows=4):
    """Vector-IR building blocks of the matrix-vector path, ``rows`` rows or columns at a time.

    Returns ``(dot, axpy)``, intrinsics callable from jitted code (``rows=1`` gives
    a single dot product):

    * ``dot(kv, m, m_off, m_rs, x, x_off, out, out_off)``: ``out[out_off + r] =
      sum_p M[r, p] * x[p]`` for ``r < rows`` and ``p < kv`` (``kv`` a multiple of
      ``lanes``); rows contiguous, ``m_rs`` apart.  Two accumulators per row keep
      enough FMAs in flight.
    * ``axpy(nv, m, m_off, m_cs, x, x_off, x_s, y, y_off)``: ``y[i] += sum_c
      M[i, c] * x[c]`` for ``c < rows`` columns (``m_cs`` apart, each contiguous)
      and ``i < nv`` (a multiple of ``lanes``).
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize

    def setup(context, builder):
        fl = context.get_value_type(nb_float)
        return ir.VectorType(fl, lanes), context.get_value_type(types.intp)

    def emit_dot(context, builder, sig, args):
        kv, m, m_off, m_rs, x, x_off, out, out_off = args
        vec, intp = setup(context, builder)
        m_ptr = _data(context, builder, sig.args[1], m, m_off)
        x_ptr = _data(context, builder, sig.args[4], x, x_off)
        o_ptr = _data(context, builder, sig.args[6], out, out_off)
        zero = ir.Constant(vec, [0.0] * lanes)
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(rows)]
        row_ptrs = [builder.gep(m_ptr, [builder.mul(ir.Constant(intp, r), m_rs)]) for r in range(rows)]
        step = ir.Constant(intp, 2 * lanes)
        pairs = builder.sdiv(kv, step)
        with cgutils.for_range(builder, pairs) as loop:
            base = builder.mul(loop.index, step)
            # The rows stream from memory: ask for their lines well before they are read.
            for r in range(rows):
                for half in range(2):
                    at = builder.add(base, ir.Constant(intp, GEMV_PREFETCH // esize + half * lanes))
                    _prefetch(builder, builder.gep(row_ptrs[r], [at]))
            for half in range(2):
                p = builder.add(base, ir.Constant(intp, half * lanes))
                xv = builder.load(_vector_ptr(builder, x_ptr, p, vec), align=esize)
                for r in range(rows):
                    mv = builder.load(_vector_ptr(builder, row_ptrs[r], p, vec), align=esize)
                    builder.store(_fma(builder, mv, xv, builder.load(acc[r][half])), acc[r][half])
        with builder.if_then(builder.icmp_signed("!=", builder.mul(pairs, step), kv)):
            p = builder.mul(pairs, step)
            xv = builder.load(_vector_ptr(builder, x_ptr, p, vec), align=esize)
            for r in range(rows):
                mv = builder.load(_vector_ptr(builder, row_ptrs[r], p, vec), align=esize)
                builder.store(_fma(builder, mv, xv, builder.load(acc[r][0])), acc[r][0])
        for r in range(rows):
            total = builder.fadd(builder.load(acc[r][0]), builder.load(acc[r][1]))
            builder.store(_reduce_add(builder, total), builder.gep(o_ptr, [ir.Constant(intp, r)]))
        return context.get_dummy_value()

    def emit_axpy(context, builder, sig, args):
        nv, m, m_off, m_cs, x, x_off, x_s, y, y_off = args
        vec, intp = setup(context, builder)
        m_ptr = _data(context, builder, sig.args[1], m, m_off)
        x_ptr = _data(context, builder, sig.args[4], x, x_off)
        y_ptr = _data(context, builder, sig.args[7], y, y_off)
        cols = [builder.gep(m_ptr, [builder.mul(ir.Constant(intp, c), m_cs)]) for c in range(rows)]
        xs = [_splat(builder, builder.load(builder.gep(x_ptr, [builder.mul(ir.Constant(intp, c), x_s)])), vec)
              for c in range(rows)]
        step = ir.Constant(intp, lanes)
        with cgutils.for_range(builder, builder.sdiv(nv, step)) as loop:
            i = builder.mul(loop.index, step)
            y_vec = _vector_ptr(builder, y_ptr, i, vec)
            total = builder.load(y_vec, align=esize)
            at = builder.add(i, ir.Constant(intp, GEMV_PREFETCH // esize))
            for c in range(rows):
                _prefetch(builder, builder.gep(cols[c], [at]))
                mv = builder.load(_vector_ptr(builder, cols[c], i, vec), align=esize)
                total = _fma(builder, mv, xs[c], total)
            builder.store(total, y_vec, align=esize)
        return context.get_dummy_value()

    @intrinsic
    def dot(typingctx, kv, m, m_off, m_rs, x, x_off, out, out_off):
        i = types.intp
        return types.void(i, m, i, i, x, i, out, i), emit_dot

    @intrinsic
    def axpy(typingctx, nv, m, m_off, m_cs, x, x_off, x_s, y, y_off):
        i = types.intp
        return types.void(i, m, i, i, x, i, i, y, i), emit_axpy

    return dot, axpy


def make_masked_fma(dtype, lanes):
    """Build the intrinsic adding ``w`` times up to ``lanes`` pixels of an image row into a row.

    Signature (jitted code only)::

        masked_fma(x, src, first, W, count, w, acc, a_off)

    For lanes ``l < count``: ``acc[a_off + l] += w * x[src + l]``, the pixel reading as 0
    unless ``0 <= first + l < W`` (``first``: its column in a row of ``W`` pixels).
    Pixels off the row are never loaded; ``acc`` past ``count`` is untouched.  The
    inner step of the direct convolution along a stride-1 output row.
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        x, src, first, W, count, w, acc, a_off = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        zero_i = ir.Constant(intp, 0)
        wanted = _lane_range(builder, zero_i, zero_i, count, lanes)
        inside = builder.and_(wanted, _lane_range(builder, first, zero_i, W, lanes))
        pixels = _masked_load(builder, _data(context, builder, sig.args[0], x, zero_i), src,
                              inside, vec)
        acc_ptr = _data(context, builder, sig.args[6], acc, zero_i)
        total = _fma(builder, _splat(builder, w, vec), pixels,
                     _masked_load(builder, acc_ptr, a_off, wanted, vec))
        _masked_store(builder, total, acc_ptr, a_off, wanted)
        return context.get_dummy_value()

    @intrinsic
    def masked_fma(typingctx, x, src, first, W, count, w, acc, a_off):
        i = types.intp
        return types.void(x, i, i, i, i, nb_float, acc, i), emit

    masked_fma.__name__ = f"{np.dtype(dtype).char}_masked_fma_{lanes}"
    return masked_fma


def make_direct_row(dtype, lanes, to_output=False, vectors=1):
    """Build the intrinsic adding one channel's whole kernel window into ``vectors*lanes`` output pixels.

    Signature (jitted code only)::

        direct_row(x, src, s_row, y0, H, first, W, count, w, w_off, kh, kw, dy, dx, acc, a_off)

    For lanes ``l < count`` (at most ``vectors*lanes``): ``acc[a_off + l] += sum_{i<kh, j<kw}
    w[w_off + i*kw + j] * x[src + i*dy*s_row + j*dx + l]``, a pixel reading as 0 unless
    its row ``y0 + i*dy`` lies in ``[0, H)`` and its column ``first + j*dx + l`` in
    ``[0, W)``.  The sums stay in registers across the kernel window: one load and one
    store of ``acc`` per vector and call.  The ``vectors`` sums are independent FMA
    chains sharing each weight's broadcast: one chain alone waits on the FMA latency
    at every tap.

    With ``to_output`` the sum starts from zero and is finished in the register
    instead (one input channel per output channel: depthwise layers)::

        direct_row(x, src, s_row, y0, H, first, W, count, w, w_off, kh, kw, dy, dx,
                   out, o_off, bias, epi)

    stores ``sum + bias`` (``EPI_BIAS_ROW`` in ``epi``) through ``EPI_RELU`` /
    ``EPI_RELU6`` at ``out[o_off + l]``, lanes ``l < count``.
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        x, src, s_row, y0, H, first, W, count, w, w_off, kh, kw, dy, dx, acc, a_off = args[:16]
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        zero_i = ir.Constant(intp, 0)
        x_ptr = _data(context, builder, sig.args[0], x, zero_i)
        w_ptr = _data(context, builder, sig.args[8], w, w_off)
        acc_ptr = _data(context, builder, sig.args[14], acc, zero_i)
        at = [ir.Constant(intp, v * lanes) for v in range(vectors)]
        wanted = [_lane_range(builder, at[v], zero_i, count, lanes) for v in range(vectors)]
        totals = [cgutils.alloca_once_value(
            builder, ir.Constant(vec, [0.0] * lanes) if to_output
            else _masked_load(builder, acc_ptr, builder.add(a_off, at[v]), wanted[v], vec))
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
                weight = _splat(builder, builder.load(builder.gep(w_ptr, [builder.add(builder.mul(i, kw), j)])),
                                vec)
                for v in range(vectors):
                    mask = builder.and_(builder.select(inside, wanted[v], no_lanes), _lane_range(
                        builder, builder.add(builder.add(first, shift), at[v]), zero_i, W, lanes))
                    pixels = _masked_load(builder, x_ptr, builder.add(builder.add(row_src, shift), at[v]),
                                          mask, vec)
                    builder.store(_fma(builder, weight, pixels, builder.load(totals[v])), totals[v])
        for v in range(vectors):
            result = builder.load(totals[v])
            if to_output:
                bias, epi = args[16:]
                result = _finish_scalar_bias(builder, result, _epi_flags(builder, epi),
                                             _splat(builder, bias, vec))
            _masked_store(builder, result, acc_ptr, builder.add(a_off, at[v]), wanted[v])
        return context.get_dummy_value()

    i = types.intp
    if to_output:
        @intrinsic
        def direct_row(typingctx, x, src, s_row, y0, H, first, W, count, w, w_off, kh, kw, dy,
                       dx, out, o_off, bias, epi):
            return types.void(x, i, i, i, i, i, i, i, w, i, i, i, i, i, out, i, nb_float, i), emit
    else:
        @intrinsic
        def direct_row(typingctx, x, src, s_row, y0, H, first, W, count, w, w_off, kh, kw, dy,
                       dx, acc, a_off):
            return types.void(x, i, i, i, i, i, i, i, w, i, i, i, i, i, acc, i), emit

    direct_row.__name__ = (f"{np.dtype(dtype).char}_direct_row_{lanes}x{vectors}"
                           f"{'_out' if to_output else ''}")
    return direct_row


def make_depthwise_rows(dtype, lanes, vectors, rows):
    """Build the intrinsic computing ``rows`` output rows of one depthwise channel.

    Signature (jitted code only)::

        depthwise_rows(xp, src, s_row, row_step, count, w, w_off, kh, kw, dy, dx,
                       out, o_off, o_row, bias, epi)

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
    nb_float = _NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize

    def emit(context, builder, sig, args):
        (xp, src, s_row, row_step, count, w, w_off, kh, kw, dy, dx, out, o_off, o_row,
         bias, epi) = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        zero_i = ir.Constant(intp, 0)
        x_ptr = _data(context, builder, sig.args[0], xp, zero_i)
        w_ptr = _data(context, builder, sig.args[5], w, w_off)
        out_ptr = _data(context, builder, sig.args[11], out, zero_i)
        at = [ir.Constant(intp, v * lanes) for v in range(vectors)]
        row_at = [builder.mul(ir.Constant(intp, r), row_step) for r in range(rows)]
        sums = [[cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes))
                 for _ in range(vectors)] for _ in range(rows)]
        with cgutils.for_range(builder, kh) as row_loop:
            i = row_loop.index
            tap_row = builder.add(src, builder.mul(builder.mul(i, dy), s_row))
            with cgutils.for_range(builder, kw) as col_loop:
                j = col_loop.index
                weight = _splat(builder, builder.load(builder.gep(w_ptr, [builder.add(builder.mul(i, kw), j)])),
                                vec)
                base = builder.add(tap_row, builder.mul(j, dx))
                for r in range(rows):
                    for v in range(vectors):
                        at_rv = builder.add(builder.add(base, row_at[r]), at[v])
                        pixels = builder.load(_vector_ptr(builder, x_ptr, at_rv, vec), align=esize)
                        builder.store(_fma(builder, weight, pixels, builder.load(sums[r][v])), sums[r][v])
        flags = _epi_flags(builder, epi)
        bias_v = _splat(builder, bias, vec)
        for v in range(vectors):
            wanted = _lane_range(builder, at[v], zero_i, count, lanes)
            for r in range(rows):
                result = _finish_scalar_bias(builder, builder.load(sums[r][v]), flags, bias_v)
                dst = builder.add(builder.add(o_off, builder.mul(ir.Constant(intp, r), o_row)), at[v])
                _masked_store(builder, result, out_ptr, dst, wanted)
        return context.get_dummy_value()

    i = types.intp

    @intrinsic
    def depthwise_rows(typingctx, xp, src, s_row, row_step, count, w, w_off, kh, kw, dy, dx,
                       out, o_off, o_row, bias, epi):
        return types.void(xp, i, i, i, i, w, i, i, i, i, i, out, i, i, nb_float, i), emit

    depthwise_rows.__name__ = f"{np.dtype(dtype).char}_depthwise_rows_{lanes}x{vectors}x{rows}"
    return depthwise_rows


def make_depthwise_flat(dtype, lanes, vectors, inside=False):
    """Build the intrinsic computing ``vectors`` output vectors of a depthwise channel
    whose output plane has the input's width, its rows end to end.

    Signature (jitted code only)::

        depthwise_flat(x, src, taps, ntaps, w, w_off, masks, starts, rows, v0, nv,
                       out, o_off, bias, epi)

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

        depthwise_flat(x, src, taps, ntaps, w, w_off, masks, m_off, out, o_off, bias, epi)

    Vector ``u`` covers ``out[o_off + u*lanes:]`` and reads ``x[src + u*lanes +
    taps[t]:]`` unmasked; lanes across a row's edge are zeroed by ANDing them with
    ``masks[m_off + taps[ntaps + t] + u*lanes:]``, unless ``taps[ntaps + t]`` is
    negative (a tap that never crosses one).

    Either way the pixel is zeroed, not the product: padding times an infinite
    weight is NaN, as in a zero-padded convolution.
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize

    def emit(context, builder, sig, args):
        if inside:
            x, src, taps, ntaps, w, w_off, masks, m_off, out, o_off, bias, epi = args
            out_type = sig.args[8]
        else:
            (x, src, taps, ntaps, w, w_off, masks, starts, rows, v0, nv, out, o_off, bias,
             epi) = args
            out_type = sig.args[11]
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        ivec = ir.VectorType(ir.IntType(8 * esize), lanes)
        zero_i = ir.Constant(intp, 0)
        x_ptr = _data(context, builder, sig.args[0], x, src)
        tap_ptr = _data(context, builder, sig.args[2], taps, zero_i)
        w_ptr = _data(context, builder, sig.args[4], w, w_off)
        out_ptr = _data(context, builder, out_type, out, o_off)
        if inside:
            mask_ptr = _data(context, builder, sig.args[6], masks, m_off)
            at = mask_at = [ir.Constant(intp, u * lanes) for u in range(vectors)]
        else:
            mask_ptr = _data(context, builder, sig.args[6], masks, zero_i)
            start_ptr = _data(context, builder, sig.args[7], starts, zero_i)
            row_ptr = _data(context, builder, sig.args[8], rows, zero_i)
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
                ptr = _vector_ptr(builder, x_ptr, builder.add(offset, at[u]), vec)
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
                        pixels = _masked_load_call(builder, ptr, esize, builder.icmp_signed(
                            "<", on, ir.Constant(ivec, [0] * lanes)))
                builder.store(_fma(builder, weight, pixels, builder.load(sums[u])), sums[u])

        with cgutils.for_range(builder, ntaps) as loop:
            t = loop.index
            offset = builder.load(builder.gep(tap_ptr, [t]))
            column = builder.load(builder.gep(tap_ptr, [builder.add(t, ntaps)]))
            weight = _splat(builder, builder.load(builder.gep(w_ptr, [t])), vec)
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
        flags = _epi_flags(builder, epi)
        bias_v = _splat(builder, bias, vec)
        for u in range(vectors):
            result = _finish_scalar_bias(builder, builder.load(sums[u]), flags, bias_v)
            builder.store(result, _vector_ptr(builder, out_ptr, at[u], vec), align=esize)
        return context.get_dummy_value()

    i = types.intp

    if inside:
        @intrinsic
        def depthwise_flat(typingctx, x, src, taps, ntaps, w, w_off, masks, m_off, out, o_off,
                           bias, epi):
            _check_mask_width(masks, dtype)
            return types.void(x, i, taps, i, w, i, masks, i, out, i, nb_float, i), emit
    else:
        @intrinsic
        def depthwise_flat(typingctx, x, src, taps, ntaps, w, w_off, masks, starts, rows, v0, nv,
                           out, o_off, bias, epi):
            _check_mask_width(masks, dtype)
            return types.void(x, i, taps, i, w, i, masks, starts, rows, i, i, out, i, nb_float,
                              i), emit

    flavour = "_inside" if inside else ""
    depthwise_flat.__name__ = f"{np.dtype(dtype).char}_depthwise_flat_{lanes}x{vectors}{flavour}"
    return depthwise_flat


def make_depthwise_nhwc(dtype, lanes, shapes):
    """Build the intrinsic computing a block of output pixels x channels of a depthwise
    NHWC layer, the lanes over the channels, in one of ``shapes`` ((vectors, pixels)
    pairs) chosen at run time.

    Signature (jitted code only)::

        depthwise_nhwc(shape, x, src, pixel_step, row_step, col_step, ni, nj, w, w_off,
                       tap_step, kw, out, dst, out_step, bias, b_off, epi)

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
    nb_float = _NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize

    def emit_shape(context, builder, sig, args, vectors, pixels):
        (_, x, src, pixel_step, row_step, col_step, ni, nj, w, w_off, tap_step, kw, out, dst,
         out_step, bias, b_off, epi) = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        x_ptr = _data(context, builder, sig.args[1], x, src)
        w_ptr = _data(context, builder, sig.args[8], w, w_off)
        out_ptr = _data(context, builder, sig.args[12], out, dst)
        bias_ptr = _data(context, builder, sig.args[15], bias, b_off)
        at = [builder.mul(ir.Constant(intp, p), pixel_step) for p in range(pixels)]
        sums = [[cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes))
                 for _ in range(vectors)] for _ in range(pixels)]
        with cgutils.for_range(builder, ni) as row_loop:
            i = row_loop.index
            with cgutils.for_range(builder, nj) as col_loop:
                j = col_loop.index
                w_tap = builder.mul(builder.add(builder.mul(i, kw), j), tap_step)
                x_tap = builder.add(builder.mul(i, row_step), builder.mul(j, col_step))
                weights = [builder.load(_vector_ptr(builder, w_ptr, builder.add(
                    w_tap, ir.Constant(intp, v * lanes)), vec), align=esize)
                    for v in range(vectors)]
                for p in range(pixels):
                    base = builder.add(x_tap, at[p])
                    for v in range(vectors):
                        pix = builder.load(_vector_ptr(builder, x_ptr, builder.add(
                            base, ir.Constant(intp, v * lanes)), vec), align=esize)
                        builder.store(_fma(builder, weights[v], pix, builder.load(sums[p][v])),
                                      sums[p][v])
        flags, bias_row, bias_col = _load_bias(builder, epi, bias_ptr, 1, vectors, vec, intp,
                                               esize)
        for p in range(pixels):
            row = builder.mul(ir.Constant(intp, p), out_step)
            for v in range(vectors):
                result = _epilogue(builder, builder.load(sums[p][v]), flags, bias_row, bias_col,
                                   0, v)
                builder.store(result, _vector_ptr(builder, out_ptr, builder.add(
                    row, ir.Constant(intp, v * lanes)), vec), align=esize)

    def emit(context, builder, sig, args):
        shape = args[0]
        done = builder.append_basic_block("depthwise_nhwc.done")
        switch = builder.switch(shape, done)
        for index, (vectors, pixels) in enumerate(shapes):
            block = builder.append_basic_block(f"depthwise_nhwc.{vectors}x{pixels}")
            switch.add_case(ir.Constant(shape.type, index), block)
            builder.position_at_end(block)
            emit_shape(context, builder, sig, args, vectors, pixels)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    i = types.intp

    @intrinsic
    def depthwise_nhwc(typingctx, shape, x, src, pixel_step, row_step, col_step, ni, nj, w,
                       w_off, tap_step, kw, out, dst, out_step, bias, b_off, epi):
        return types.void(i, x, i, i, i, i, i, i, w, i, i, i, out, i, i, bias, i, i), emit

    depthwise_nhwc.__name__ = (f"{np.dtype(dtype).char}_depthwise_nhwc_{lanes}_"
                               + "_".join(f"{v}x{p}" for v, p in shapes))
    return depthwise_nhwc


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
    come out as gathers and scatters (~5 GB/s here); this one is written by hand:

    * ``s_in == 1`` (B row-major, A column-major): a row of the panel is
      ``ceil(panel/lanes)`` masked vector loads and stores, padding included;
    * ``s_k == 1`` (A row-major, B column-major): ``lanes`` values of k per vector
      load from each source row, stored as a column of the panel;
    * otherwise one scalar at a time.
    """
    dtype = np.dtype(dtype).type
    nb_float = _NUMBA_FLOAT[dtype]
    nvec = -(-panel // lanes)

    def emit(context, builder, sig, args):
        kc, src, off, s_in, s_k, count, buf, dst = args
        intp = context.get_value_type(types.intp)
        fl = context.get_value_type(nb_float)
        vec = ir.VectorType(fl, lanes)
        src_ptr = _data(context, builder, sig.args[1], src, off)
        buf_ptr = _data(context, builder, sig.args[6], buf, dst)
        one = ir.Constant(intp, 1)
        zero_i = ir.Constant(intp, 0)
        width = ir.Constant(intp, panel)

        def out_at(p, i):
            return builder.gep(buf_ptr, [builder.add(builder.mul(p, width), i)])

        with builder.if_else(builder.icmp_signed("==", s_in, one)) as (contiguous, other):
            with contiguous:
                # Loads past `count` are masked off (they read as zero: the padding);
                # stores stop at the panel's width.
                loads = [_lane_range(builder, ir.Constant(intp, v * lanes), zero_i, count, lanes)
                         for v in range(nvec)]
                stores = [_lane_range(builder, ir.Constant(intp, v * lanes), zero_i, width, lanes)
                          for v in range(nvec)]
                lines = -(-panel * np.dtype(dtype).itemsize // 64)
                with cgutils.for_range(builder, kc) as loop:
                    p = loop.index
                    row = builder.mul(p, s_k)
                    # The next panel (``panel`` columns on) packs the same rows next:
                    # ask for its lines now, the source rows lie far apart in memory.
                    for q in range(lines):
                        _prefetch(builder, builder.gep(src_ptr, [builder.add(
                            row, ir.Constant(intp, panel + q * 64 // np.dtype(dtype).itemsize))]))
                    for v in range(nvec):
                        at = ir.Constant(intp, v * lanes)
                        value = _masked_load(builder, src_ptr, builder.add(row, at), loads[v], vec)
                        target = builder.add(builder.mul(p, width), at)
                        if (v + 1) * lanes <= panel:
                            builder.store(value, _vector_ptr(builder, buf_ptr, target, vec), align=_esize(vec))
                        else:
                            _masked_store(builder, value, buf_ptr, target, stores[v])
            with other:
                _pack_columns(builder, src_ptr, s_in, s_k, kc, count, out_at, vec, intp,
                              builder.mul(ir.Constant(intp, panel), s_in))
                # Zero the padding columns i in [count, panel).
                zero = ir.Constant(fl, 0.0)
                with cgutils.for_range(builder, kc) as loop:
                    with cgutils.for_range(builder, builder.sub(width, count)) as pad:
                        builder.store(zero, out_at(loop.index, builder.add(count, pad.index)))
        return context.get_dummy_value()

    @intrinsic
    def pack_panel(typingctx, kc, src, off, s_in, s_k, count, buf, dst):
        i = types.intp
        return types.void(i, src, i, i, i, i, buf, i), emit

    pack_panel.__name__ = f"{np.dtype(dtype).char}_pack_panel_{panel}"
    return pack_panel


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
                    value = builder.load(_vector_ptr(builder, row_ptr, p0, vec), align=_esize(vec))
                    _prefetch(builder, builder.gep(row_ptr, [builder.add(ahead, p0)]))
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
