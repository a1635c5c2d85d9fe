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

EPI_BIAS_ROW = 1
EPI_BIAS_COL = 2
EPI_RELU = 4
EPI_RELU6 = 8

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
    suffix = f"v{vec.count}{'f32' if isinstance(vec.element, ir.FloatType) else 'f64'}"
    fn = builder.module.declare_intrinsic(f"llvm.fma.{suffix}", fnty=ir.FunctionType(vec, [vec] * 3))
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


def make_microkernel(dtype, mr, nr, lanes, strided=False):
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

    Returns
    -------
    numba intrinsic, callable from jitted code only.
    """
    dtype = np.dtype(dtype).type
    if nr % lanes:
        raise ValueError(f"NR={nr} is not a multiple of the vector width {lanes}")
    nb_float = _NUMBA_FLOAT[dtype]
    shape = (dtype, mr, nr, lanes)

    if strided:
        def emit(context, builder, sig, args):
            (kc, a, a_off, a_rs, a_cs, b, b_off, ldb, c, c_off, ldc,
             alpha, beta, bias, bias_off, epi) = args
            ptrs = [_data(context, builder, sig.args[i], args[i], args[i + 1]) for i in (1, 5)]
            c_ptr = _data(context, builder, sig.args[8], c, c_off)
            bias_ptr = _data(context, builder, sig.args[13], bias, bias_off)
            _call_tile(context, builder, shape, False, kc, ptrs[0], a_rs, a_cs, ptrs[1], ldb,
                       c_ptr, ldc, alpha, beta, bias_ptr, epi)
            return context.get_dummy_value()

        @intrinsic
        def ukernel(typingctx, kc, a, a_off, a_rs, a_cs, b, b_off, ldb, c, c_off, ldc,
                    alpha, beta, bias, bias_off, epi):
            i = types.intp
            sig = types.void(i, a, i, i, i, b, i, i, c, i, i, nb_float, nb_float, bias, i, i)
            return sig, emit
    else:
        def emit(context, builder, sig, args):
            kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias, bias_off, epi = args
            intp = context.get_value_type(types.intp)
            a_ptr = _data(context, builder, sig.args[1], a, a_off)
            b_ptr = _data(context, builder, sig.args[3], b, b_off)
            c_ptr = _data(context, builder, sig.args[5], c, c_off)
            bias_ptr = _data(context, builder, sig.args[10], bias, bias_off)
            _call_tile(context, builder, shape, True, kc, a_ptr, ir.Constant(intp, 1),
                       ir.Constant(intp, mr), b_ptr, ir.Constant(intp, nr), c_ptr, ldc, alpha, beta,
                       bias_ptr, epi)
            return context.get_dummy_value()

        @intrinsic
        def ukernel(typingctx, kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias, bias_off, epi):
            sig = types.void(types.intp, a, types.intp, b, types.intp, c, types.intp, types.intp,
                             nb_float, nb_float, bias, types.intp, types.intp)
            return sig, emit

    ukernel.__name__ = f"{np.dtype(dtype).char}_ukernel_{mr}x{nr}{'_strided' if strided else ''}"
    return ukernel


def _data(context, builder, array_type, array, offset):
    """Pointer to element ``offset`` of a Numba array argument."""
    return builder.gep(context.make_array(array_type)(context, builder, array).data, [offset])


def _call_tile(context, builder, shape, packed, kc, a_ptr, a_rs, a_cs, b_ptr, ldb, c_ptr, ldc,
               alpha, beta, bias_ptr, epi):
    """Call the tile function, defining it in this LLVM module on first use.

    One out-of-line definition per module and flavour, however many call sites a
    jitted function has: LLVM then optimises the kernel once, which keeps compile
    times down; a call per tile costs nothing next to its k loop.
    """
    dtype, mr, nr, lanes = shape
    module = builder.module
    name = f"tilegemm_{np.dtype(dtype).name}_tile_{mr}x{nr}_{'packed' if packed else 'strided'}"
    args = [kc, a_ptr, a_rs, a_cs, b_ptr, ldb, c_ptr, ldc, alpha, beta, bias_ptr, epi]
    fn = module.globals.get(name)
    if fn is None:
        fnty = ir.FunctionType(ir.VoidType(), [x.type for x in args])
        fn = ir.Function(module, fnty, name)
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        body = ir.IRBuilder(fn.append_basic_block("entry"))
        p = list(fn.args)
        if packed:  # constant strides let LLVM fold the panel addressing
            p[2], p[3], p[5] = a_rs, a_cs, ldb
        _emit_tile(context, body, shape, *p)
        body.ret_void()
    builder.call(fn, args)


def _emit_tile(context, builder, shape, kc, a_ptr, a_rs, a_cs, b_ptr, ldb, c_ptr, ldc,
               alpha, beta, bias_ptr, epi):
    """The body shared by both kernel flavours: prefetch C, the k loop, the C update."""
    dtype, mr, nr, lanes = shape
    nv = nr // lanes
    fl = context.get_value_type(_NUMBA_FLOAT[dtype])
    esize = np.dtype(dtype).itemsize
    vec = ir.VectorType(fl, lanes)
    intp = context.get_value_type(types.intp)

    zero = ir.Constant(vec, [0.0] * lanes)
    acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(mr)]

    # C is read only after the k loop: start bringing its lines in now.
    line = 64 // esize
    for i in range(mr):
        row = builder.mul(ir.Constant(intp, i), ldc)
        for j in range(0, nr, line):
            _prefetch(builder, builder.gep(c_ptr, [builder.add(row, ir.Constant(intp, j))]))

    a_rows = [builder.gep(a_ptr, [builder.mul(ir.Constant(intp, i), a_rs)]) for i in range(mr)]
    # The k loop: the whole point of the kernel.
    with cgutils.for_range(builder, kc) as loop:
        k = loop.index
        b_row = builder.mul(k, ldb)
        a_col = builder.mul(k, a_cs)
        bv = [builder.load(_vector_ptr(builder, b_ptr, builder.add(b_row, ir.Constant(intp, v * lanes)), vec),
                           align=esize) for v in range(nv)]
        for i in range(mr):
            a_splat = _splat(builder, builder.load(builder.gep(a_rows[i], [a_col])), vec)
            for v in range(nv):
                builder.store(_fma(builder, a_splat, bv[v], builder.load(acc[i][v])), acc[i][v])

    alpha_v = _splat(builder, alpha, vec)
    beta_v = _splat(builder, beta, vec)
    beta_is_zero = builder.fcmp_ordered("==", beta, ir.Constant(fl, 0.0))
    zero_i = ir.Constant(epi.type, 0)

    def store_tile(read_c, fused):
        if fused:
            flags, bias_row, bias_col = _load_bias(builder, epi, bias_ptr, mr, nv, vec, intp, esize)
        for i in range(mr):
            row = builder.mul(ir.Constant(intp, i), ldc)
            for v in range(nv):
                ptr = _vector_ptr(builder, c_ptr, builder.add(row, ir.Constant(intp, v * lanes)), vec)
                r = builder.fmul(alpha_v, builder.load(acc[i][v]))
                if read_c:
                    r = _fma(builder, beta_v, builder.load(ptr, align=esize), r)
                if fused:
                    r = _epilogue(builder, r, flags, bias_row, bias_col, i, v)
                builder.store(r, ptr, align=esize)

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
    vec = r.type
    zero_v = ir.Constant(vec, [0.0] * vec.count)
    six_v = ir.Constant(vec, [6.0] * vec.count)
    # select, not fadd of a zero bias: x + 0.0 would turn -0.0 into +0.0.
    r = builder.select(flags["row"], builder.fadd(r, builder.load(bias_row[i])), r)
    r = builder.select(flags["col"], builder.fadd(r, builder.load(bias_col[v])), r)
    # Compare-and-select keeps NaN (NaN < 0 is false), unlike llvm.maxnum.
    relu = builder.select(builder.fcmp_ordered("<", r, zero_v), zero_v, r)
    r = builder.select(builder.or_(flags["relu"], flags["relu6"]), relu, r)
    r6 = builder.select(builder.fcmp_ordered(">", r, six_v), six_v, r)
    return builder.select(flags["relu6"], r6, r)


def _load_bias(builder, epi, bias_ptr, mr, nv, vec, intp, esize):
    """Read the bias into allocas, each load guarded by its flag so an absent bias is never read."""
    lanes = vec.count

    def flag(bit):
        return builder.icmp_signed("!=", builder.and_(epi, ir.Constant(epi.type, bit)),
                                   ir.Constant(epi.type, 0))

    flags = {"row": flag(EPI_BIAS_ROW), "col": flag(EPI_BIAS_COL),
             "relu": flag(EPI_RELU), "relu6": flag(EPI_RELU6)}
    zero = ir.Constant(vec, [0.0] * lanes)
    bias_row = [cgutils.alloca_once_value(builder, zero) for _ in range(mr)]
    bias_col = [cgutils.alloca_once_value(builder, zero) for _ in range(nv)]
    with builder.if_then(flags["row"]):
        for i in range(mr):
            value = builder.load(builder.gep(bias_ptr, [ir.Constant(intp, i)]))
            builder.store(_splat(builder, value, vec), bias_row[i])
    with builder.if_then(flags["col"]):
        for v in range(nv):
            ptr = _vector_ptr(builder, bias_ptr, ir.Constant(intp, v * lanes), vec)
            builder.store(builder.load(ptr, align=esize), bias_col[v])
    return flags, bias_row, bias_col

