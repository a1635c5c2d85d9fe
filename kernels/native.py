"""Native shares: a share of a product handed to a pool thread without the GIL.

A share given to a pool thread as a Python call costs that thread the GIL twice
(to start the call, to finish it) while the caller holds it or waits for it:
each handoff is a futex wake-up, about 30 us a call on a 2-vCPU VM, which is more
than a 128^3 product takes on one core.  A native share is two integers instead:
the address of a C function ``void share(int64 *block)`` and the address of its
argument block.  A pool worker spinning in jitted code (``serve`` in
:mod:`tilegemm.kernels.pool`) calls it there and publishes its completion flag,
never touching Python; the caller runs its own share the same way.

An argument block is a row of an int64 array: integers as they are, floats by
their float64 bits (:func:`bits_of`, :func:`float_bits`), arrays as ``(address,
size)`` (:func:`put_array`, :func:`array_at`).  The block and every array it names
must stay alive until the share is done (the caller holds them until the pool
reports it).  Each kind of share has a jitted writer of its blocks and a reader
of one, a C function (``ground.contracts.c_entry``), side by side in each kernel's
shares module (``kernels/_tile_shares.py``, the same layout in both); the reader
calls the same jitted driver a Python call runs.
"""
import llvmlite.ir as ir
import numba
import numpy as np
from numba import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

#: The C signature of every native share.
SHARE = types.void(types.CPointer(types.int64))


@intrinsic
def call_share(typingctx, address, block):
    """Call the native share at ``address`` with the argument block at ``block``
    (both addresses as integers)."""
    if not (isinstance(address, types.Integer) and isinstance(block, types.Integer)):
        raise TypeError("call_share takes two addresses (integers)")

    def emit(context, builder, sig, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64.as_pointer()])
        fn = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64),
                              fnty.as_pointer())
        ptr = builder.inttoptr(context.cast(builder, args[1], sig.args[1], types.int64),
                               i64.as_pointer())
        builder.call(fn, [ptr])
        return context.get_dummy_value()

    return types.void(address, block), emit


@intrinsic
def _voidptr(typingctx, address):
    def emit(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), emit


@intrinsic
def float_bits(typingctx, bits):
    """The float64 whose bits are the int64 ``bits`` (a float stored in a block)."""
    def emit(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), emit


@intrinsic
def bits_of(typingctx, value):
    """The int64 holding the bits of the float64 ``value`` (a float stored in a block)."""
    def emit(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), emit


@intrinsic
def data_address(typingctx, array):
    """The address of ``array``'s first element, as an int64 (``array.ctypes.data``
    without the ctypes object Numba would lower for it)."""
    if not isinstance(array, types.Array):
        raise TypeError("data_address takes an array")

    def emit(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return types.int64(array), emit


@intrinsic
def as_c_order(typingctx, array):
    """``array`` (typed of any layout) typed C-contiguous: the same data, shape and
    strides, for a caller that has checked them (:func:`c_ordered`)."""
    if not isinstance(array, types.Array):
        raise TypeError("as_c_order takes an array")

    def emit(context, builder, sig, args):
        return impl_ret_borrowed(context, builder, sig.return_type, args[0])

    return array.copy(layout="C")(array), emit


@intrinsic
def flat_view(typingctx, array):
    """The C-ordered ``array`` (:func:`c_ordered`, typed of any layout) as a 1-D
    C-contiguous array of its items, borrowed: valid while ``array`` lives.  Numba's
    ``reshape(-1)`` calls a stride helper and counts a reference to the data, atomic
    increments and decrements that cost a 4x4 product as much as its arithmetic."""
    if not isinstance(array, types.Array):
        raise TypeError("flat_view takes an array")
    flat = types.Array(array.dtype, 1, "C")

    def emit(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(flat)(context, builder)
        context.populate_array(dst, data=src.data, shape=[src.nitems], strides=[src.itemsize],
                               itemsize=src.itemsize,
                               meminfo=ir.Constant(src.meminfo.type, None))
        return dst._getvalue()

    return flat(array), emit


@intrinsic
def borrowed(typingctx, array):
    """``array`` without its reference count: the same type and items, valid while
    ``array`` lives.  A jitted function that works on ``borrowed`` forms of its
    arguments does no atomic reference counting on them (Numba counts a reference
    each time an array is passed to an inlined helper: twenty such increments and
    decrements took 0.14 us of a 4x4 product's 0.35)."""
    if not isinstance(array, types.Array):
        raise TypeError("borrowed takes an array")

    def emit(context, builder, sig, args):
        view = context.make_array(sig.args[0])(context, builder, args[0])
        view.meminfo = ir.Constant(view.meminfo.type, None)
        view.parent = ir.Constant(view.parent.type, None)
        return view._getvalue()

    return array(array), emit


@numba.njit(inline="always", nogil=True)
def c_ordered(x):
    """Whether the 2-D array ``x`` is C-contiguous (strictly: its strides are those of
    its shape) and its data aligned to its item size."""
    size = x.itemsize
    return (x.strides[1] == size and x.strides[0] == x.shape[1] * size
            and data_address(x) % size == 0)


@numba.njit(inline="always", nogil=True)
def tiny_operands(a, b, c):
    """Whether ``c = a @ b`` may run on 2-D ``a``, ``b``, ``c`` typed of any layout as on
    C-contiguous ones: all three :func:`c_ordered` and ``c`` of the product's shape
    (``a`` and ``b`` are known to match)."""
    return (c_ordered(a) and c_ordered(b) and c_ordered(c)
            and c.shape[0] == a.shape[0] and c.shape[1] == b.shape[1])


@numba.njit(inline="always", nogil=True)
def put_array(block, at, array):
    """``block[at], block[at + 1] = address, size`` of the 1-D contiguous ``array``."""
    block[at] = data_address(array)
    block[at + 1] = array.size


@numba.njit(inline="always", nogil=True)
def put_range(block, at, base, offset, size):
    """``block[at], block[at + 1]`` = address and size of ``base[offset:offset + size]``
    (``base`` 1-D contiguous): a share's buffer cut from one scratch array."""
    block[at] = data_address(base) + offset * base.itemsize
    block[at + 1] = size


@numba.njit(inline="always", nogil=True)
def array_at(block, at, dtype):
    """The 1-D array whose ``(address, size)`` are ``block[at], block[at + 1]``."""
    return numba.carray(_voidptr(block[at]), block[at + 1], dtype)


@numba.njit(nogil=True, cache=True)
def run_share(address, block):
    """Run one native share on this thread (the GIL is free meanwhile)."""
    call_share(address, block)


@numba.njit(inline="always", nogil=True)
def put_operand(block, at, operand):
    """An operand ``(flat, (offset, row_stride, col_stride))`` into five slots."""
    flat, (off, rs, cs) = operand
    put_array(block, at, flat)
    block[at + 2], block[at + 3], block[at + 4] = off, rs, cs


@numba.njit(inline="always", nogil=True)
def operand_at(block, at, dtype):
    """The operand :func:`put_operand` wrote at ``at``."""
    return array_at(block, at, dtype), (block[at + 2], block[at + 3], block[at + 4])


@numba.njit(inline="always", nogil=True)
def batch_at(block):
    """A batch's ``(dims, steps)`` from slots 3-6 (``steps`` is 3 x ``dims.size``)."""
    dims = array_at(block, 3, np.int64)
    return dims, array_at(block, 5, np.int64).reshape((3, dims.size))
