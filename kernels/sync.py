"""Intrinsics threads coordinate with: a shared task counter, release/acquire flags,
the spin-wait hint, and a prefetch callable from jitted code."""
import platform

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.kernels.ir import data_ptr, prefetch_line

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


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
        ptr = data_ptr(context, builder, sig.args[0], args[0], ir.Constant(ir.IntType(64), 0))
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), emit


def _element_ptr(context, builder, sig, args):
    """Pointer to ``array[index]`` for an intrinsic called as ``f(array, index, ...)``."""
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    return data_ptr(context, builder, sig.args[0], args[0], idx)


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
        prefetch_line(builder, _element_ptr(context, builder, sig, args))
        return context.get_dummy_value()

    return types.void(array, index), emit
