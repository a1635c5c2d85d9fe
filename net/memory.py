"""Activation buffers reused by liveness.

A network's first run on an input shape records the shape and dtype of every step's
outputs; later runs of that shape take each output's buffer from a free list and
give it back after the tensor's last reader, so a steady-state run allocates no
activations but its outputs (what numpy allocates inside a step aside: pooling's
padded copy, a Pad).  Buffers belong to one calling thread (a :class:`Buffers` per
thread and shape), so concurrent calls never share one.
"""
import numpy as np


class Buffers:
    """Free arrays by (shape, dtype) and the ones handed out, for one shape and thread."""

    def __init__(self):
        self.free = {}
        self.owned = {}                 # id -> array, every array this pool made

    def take(self, shape, dtype):
        """A buffer of ``shape`` and ``dtype``: a free one, else a new one."""
        stack = self.free.get((shape, dtype))
        if stack:
            return stack.pop()
        a = np.empty(shape, dtype)
        self.owned[id(a)] = a
        return a

    def give(self, a, live):
        """Return ``a`` (if it is one of ours) unless a ``live`` array may share its memory."""
        if self.owned.get(id(a)) is not a:
            return
        if any(np.may_share_memory(v, a) for v in live):
            return
        self.free.setdefault((a.shape, a.dtype), []).append(a)

    def holds(self, x):
        """Whether ``x`` may be (a view of) one of this pool's buffers."""
        return any(np.may_share_memory(x, a) for a in self.owned.values())
