"""The vector-IR toolkit every generated kernel is written with.

Small llvmlite emitters shared by the micro-kernel, GEMV, transforms, direct
convolution and packer generators: broadcasts, FMAs, prefetches, vector pointers
into Numba arrays, masked loads and stores, lane masks, shuffles, reductions and
the fused epilogue (bias, relu, relu6).  Each takes the ``builder`` of the function
being emitted; none defines a function of its own.
"""
from contextlib import nullcontext

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils

from tilegemm.ground.contracts import (EPI_ACCUMULATE, EPI_BIAS_COL, EPI_BIAS_ROW, EPI_RELU,
                                       EPI_RELU6)

#: Numba's float type for each supported numpy dtype.
NUMBA_FLOAT = {np.float32: types.float32, np.float64: types.float64}


def splat(builder, value, vec_type):
    """Broadcast a scalar into every lane."""
    undef = ir.Constant(vec_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), vec_type.count), [0] * vec_type.count)
    return builder.shuffle_vector(one, undef, mask)


def fma(builder, a, b, c):
    """``a*b + c`` with one rounding, on vectors (llvmlite's builder.fma is scalar-only)."""
    vec = a.type
    fn = builder.module.declare_intrinsic(f"llvm.fma.{vec_suffix(vec)}",
                                          fnty=ir.FunctionType(vec, [vec] * 3))
    return builder.call(fn, [a, b, c])


def prefetch_line(builder, ptr):
    """Ask for the cache line at ``ptr`` in L1 (read, high locality)."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = builder.module.declare_intrinsic(
        "llvm.prefetch.p0", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                      ir.Constant(i32, 1)])


def vector_ptr(builder, base, offset, vec_type):
    return builder.bitcast(builder.gep(base, [offset]), vec_type.as_pointer())


def check_mask_width(masks, dtype):
    """Load masks are integers as wide as the float (typing time, a clear error)."""
    if masks.dtype.bitwidth != 8 * np.dtype(dtype).itemsize:
        raise TypeError(f"masks must be {8 * np.dtype(dtype).itemsize}-bit integers")


def data_ptr(context, builder, array_type, array, offset):
    """Pointer to element ``offset`` of a Numba array argument."""
    return builder.gep(context.make_array(array_type)(context, builder, array).data, [offset])


def epilogue(builder, r, flags, bias_row, bias_col, i, v):
    """Bias and activation on one accumulator vector, selected at run time by ``epi``."""
    # select, not fadd of a zero bias: x + 0.0 would turn -0.0 into +0.0.
    r = builder.select(flags["row"], builder.fadd(r, builder.load(bias_row[i])), r)
    r = builder.select(flags["col"], builder.fadd(r, builder.load(bias_col[v])), r)
    return activation(builder, r, flags["relu"], flags["relu6"])


def epi_flags(builder, epi):
    """The run-time epilogue flags of ``epi`` as i1 values: row, col, relu, relu6."""
    def flag(bit):
        return builder.icmp_signed("!=", builder.and_(epi, ir.Constant(epi.type, bit)),
                                   ir.Constant(epi.type, 0))

    return {"row": flag(EPI_BIAS_ROW), "col": flag(EPI_BIAS_COL),
            "relu": flag(EPI_RELU), "relu6": flag(EPI_RELU6), "acc": flag(EPI_ACCUMULATE)}


def constant_flags(epi):
    """:func:`epi_flags` of an ``epi`` known when the code is generated: i1 constants,
    which fold every select they choose."""
    bit = ir.IntType(1)
    return {name: ir.Constant(bit, int(bool(epi & value))) for name, value in (
        ("row", EPI_BIAS_ROW), ("col", EPI_BIAS_COL), ("relu", EPI_RELU), ("relu6", EPI_RELU6),
        ("acc", EPI_ACCUMULATE))}


def finish_scalar_bias(builder, r, flags, bias_v, held=None):
    """``r + bias_v`` when the row-bias flag is set, plus ``held()`` (what the output
    holds, loaded only under the flag) when the accumulate flag is, then the activation."""
    # select, not the add of a zero bias: r + 0.0 would turn -0.0 into +0.0.
    r = builder.select(flags["row"], builder.fadd(r, bias_v), r)
    if held is not None:             # a branch: without the flag the output is not read
        with builder.if_else(flags["acc"]) as (then, otherwise):
            with then:
                summed, summed_at = builder.fadd(r, held()), builder.block
            with otherwise:
                plain_at = builder.block
        merged = builder.phi(r.type)
        merged.add_incoming(summed, summed_at)
        merged.add_incoming(r, plain_at)
        r = merged
    return activation(builder, r, flags["relu"], flags["relu6"])


#: Epilogues the kernels write in straight-line code of their own (the micro-kernels
#: with alpha = 1, the depthwise kernels): the convolutions' bias per output channel,
#: alone or with relu/relu6.  Tested per vector, the flags' selects became a branch per
#: vector and the bias spilled to the stack: 9-10% of a 1x1 layer of 16-32 input
#: channels (Zen 3).
FAST_EPILOGUES = (EPI_BIAS_COL, EPI_BIAS_COL | EPI_RELU, EPI_BIAS_COL | EPI_RELU6)


def by_epilogue(builder, epi, cases, emit, when=None):
    """``emit(case)`` once for each of ``cases`` (epilogue flag sets), under a branch on
    ``epi`` equal to it (and on ``when``, an i1, if given), where the epilogue can be
    written with :func:`constant_flags` (every select folds: no per-vector flag tests,
    no bias spilled across them); ``emit(None)`` once for any other ``epi``, whose
    flags are tested at run time."""
    if not cases:
        emit(None)
        return
    hit = builder.icmp_signed("==", epi, ir.Constant(epi.type, cases[0]))
    if when is not None:
        hit = builder.and_(when, hit)
    with builder.if_else(hit) as (then, otherwise):
        with then:
            emit(cases[0])
        with otherwise:
            by_epilogue(builder, epi, cases[1:], emit, when)


def load_bias(builder, epi, bias_ptr, mr, nv, vec, intp, esize, rows_ok=None, masks=None,
              flags=None):
    """Read the bias into allocas, each load guarded by its flag so an absent bias is never read.

    With ``rows_ok``/``masks`` (an edge tile) only the bias of valid rows and columns is
    read.  ``flags`` (default ``epi``'s run-time flags) may be :func:`constant_flags`.
    """
    lanes = vec.count
    flags = epi_flags(builder, epi) if flags is None else flags
    zero = ir.Constant(vec, [0.0] * lanes)
    bias_row = [cgutils.alloca_once_value(builder, zero) for _ in range(mr)]
    bias_col = [cgutils.alloca_once_value(builder, zero) for _ in range(nv)]
    with builder.if_then(flags["row"]):
        for i in range(mr):
            with (builder.if_then(rows_ok[i]) if rows_ok else nullcontext()):
                value = builder.load(builder.gep(bias_ptr, [ir.Constant(intp, i)]))
                builder.store(splat(builder, value, vec), bias_row[i])
    with builder.if_then(flags["col"]):
        for v in range(nv):
            ptr = vector_ptr(builder, bias_ptr, ir.Constant(intp, v * lanes), vec)
            builder.store(load_vector(builder, ptr, esize, masks and masks[v]), bias_col[v])
    return flags, bias_row, bias_col


def load_vector(builder, ptr, esize, mask=None):
    """A vector load; with ``mask``, masked lanes are not read and come back as zero.

    Below 512 bits a full mask takes a plain load (see :func:`store_vector`).
    """
    if mask is None:
        return builder.load(ptr, align=esize)
    vec = ptr.type.pointee
    if isinstance(mask, ir.Constant) or vec.count * esize >= 64:
        return masked_load_call(builder, ptr, esize, mask)
    with builder.if_else(all_set(builder, mask)) as (full, partial):
        with full:
            plain = builder.load(ptr, align=esize)
            full_block = builder.block
        with partial:
            masked = masked_load_call(builder, ptr, esize, mask)
            partial_block = builder.block
    phi = builder.phi(vec)
    phi.add_incoming(plain, full_block)
    phi.add_incoming(masked, partial_block)
    return phi


def masked_load_call(builder, ptr, esize, mask):
    """``llvm.masked.load`` of the vector at ``ptr``: lanes off read zero, never touching memory."""
    vec = ptr.type.pointee
    fn = builder.module.declare_intrinsic(
        f"llvm.masked.load.{vec_suffix(vec)}.p0",
        fnty=ir.FunctionType(vec, [ptr.type, ir.IntType(32), mask.type, vec]))
    return builder.call(fn, [ptr, ir.Constant(ir.IntType(32), esize), mask, ir.Constant(vec, None)])


def any_set(builder, mask):
    """Whether any lane of ``mask`` is set."""
    return builder.call(builder.module.declare_intrinsic(
        f"llvm.vector.reduce.or.v{mask.type.count}i1",
        fnty=ir.FunctionType(ir.IntType(1), [mask.type])), [mask])


def all_set(builder, mask):
    """Whether every lane of ``mask`` is set (expected to be: full vectors are the common case)."""
    i1 = ir.IntType(1)
    all_set = builder.call(builder.module.declare_intrinsic(
        f"llvm.vector.reduce.and.v{mask.type.count}i1",
        fnty=ir.FunctionType(i1, [mask.type])), [mask])
    expect = builder.module.declare_intrinsic("llvm.expect.i1", fnty=ir.FunctionType(i1, [i1, i1]))
    return builder.call(expect, [all_set, ir.Constant(i1, 1)])


def store_vector(builder, value, ptr, esize, mask=None):
    """A vector store; with ``mask``, masked lanes of memory are left untouched.

    Below 512 bits a masked access is AVX's ``vmaskmov``, which AMD cores up to Zen 3
    run slowly (the store as microcode, tens of cycles; see docs/kernels.md).  There
    a full mask -- the common case -- takes a plain access, and only partial masks pay.
    """
    if mask is None:
        builder.store(value, ptr, align=esize)
        return
    fn = builder.module.declare_intrinsic(
        f"llvm.masked.store.{vec_suffix(value.type)}.p0",
        fnty=ir.FunctionType(ir.VoidType(), [value.type, ptr.type, ir.IntType(32), mask.type]))
    if isinstance(mask, ir.Constant) or value.type.count * esize >= 64:
        builder.call(fn, [value, ptr, ir.Constant(ir.IntType(32), esize), mask])
        return
    with builder.if_else(all_set(builder, mask)) as (full, partial):
        with full:
            builder.store(value, ptr, align=esize)
        with partial:
            with builder.if_then(any_set(builder, mask)):
                builder.call(fn, [value, ptr, ir.Constant(ir.IntType(32), esize), mask])


def vec_suffix(vec):
    """LLVM's overload suffix for a vector type, e.g. ``v16f32``, ``v8f64``, ``v16i32``."""
    if isinstance(vec.element, ir.IntType):
        return f"v{vec.count}i{vec.element.width}"
    return f"v{vec.count}{'f32' if isinstance(vec.element, ir.FloatType) else 'f64'}"


def esize_of(vec):
    return 4 if isinstance(vec.element, ir.FloatType) else 8


def masked_load(builder, base, offset, mask, vec):
    """``vec`` from ``base[offset:]`` where ``mask`` is set, zero elsewhere (masked lanes never touch memory)."""
    return load_vector(builder, vector_ptr(builder, base, offset, vec), esize_of(vec), mask)


def masked_store(builder, value, base, offset, mask):
    """Store the lanes of ``value`` selected by ``mask`` at ``base[offset:]``; the others are untouched."""
    store_vector(builder, value, vector_ptr(builder, base, offset, value.type), esize_of(value.type), mask)


def lane_range(builder, first, lo, hi, count):
    """Mask of the lanes ``l`` with ``lo <= first + l < hi`` (i32 arithmetic)."""
    i32 = ir.IntType(32)
    ivec = ir.VectorType(i32, count)
    pos = builder.add(splat(builder, builder.trunc(first, i32), ivec),
                      ir.Constant(ivec, list(range(count))))
    return builder.and_(builder.icmp_signed(">=", pos, splat(builder, builder.trunc(lo, i32), ivec)),
                        builder.icmp_signed("<", pos, splat(builder, builder.trunc(hi, i32), ivec)))


def activation(builder, r, relu, relu6):
    """relu (``relu`` or ``relu6`` set) then the clip at 6 (``relu6``), chosen at run time."""
    vec = r.type
    zero_v = ir.Constant(vec, [0.0] * vec.count)
    six_v = ir.Constant(vec, [6.0] * vec.count)
    # Compare-and-select keeps NaN (NaN < 0 is false), unlike llvm.maxnum.
    clipped = builder.select(builder.fcmp_ordered("<", r, zero_v), zero_v, r)
    r = builder.select(builder.or_(relu, relu6), clipped, r)
    r6 = builder.select(builder.fcmp_ordered(">", r, six_v), six_v, r)
    return builder.select(relu6, r6, r)


def shuffle(builder, a, b, indices):
    mask = ir.Constant(ir.VectorType(ir.IntType(32), len(indices)), list(indices))
    return builder.shuffle_vector(a, b, mask)


def reduce_add(builder, vec_value):
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
