"""Calling a jitted-code-only function (``ground.contracts.inner_jit``) from a test."""
import functools

import numba


@functools.lru_cache(maxsize=None)
def trampoline(fn):
    """A jitted function that calls ``fn`` with its arguments, callable from Python."""
    return numba.njit(lambda *args: fn(*args))
