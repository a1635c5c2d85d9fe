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
