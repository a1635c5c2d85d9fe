"""Activation buffers reused by liveness, hottest first.

A network's first run on an input shape records the shape and dtype of every step's
outputs; later runs of that shape take each output's buffer from a free list and
give it back after the tensor's last reader, so a steady-state run allocates no
activations but its outputs (what numpy allocates inside a step aside: a Pad).
Buffers belong to one calling thread (a :class:`Buffers` per thread and shape), so
concurrent calls never share one.

A buffer is a block of bytes, not an array of one shape: a tensor takes the most
recently freed block it fits in, so the bytes a step writes were, most of the time,
read a step or two before and are still in cache.  Blocks kept per shape (each
reused once a run, after the whole network's activations and weights went past)
made MobileNetV2's expanding 1x1 layers write into lines evicted to memory, 1.4x
slower than into cached ones.
"""
import numpy as np

#: Alignment of every buffer: a cache line, and a whole vector on every ISA.
ALIGN = 64
#: A free block more than this many times a tensor's size is passed over while a
#: snugger one fits, so that a small tensor does not hold a large block a later,
#: larger tensor then has to allocate anew.
SLACK = 4


class Buffers:
    """Blocks of memory handed out as arrays, for one input shape and thread."""

    def __init__(self):
        self.blocks = []                # every block this pool made (uint8, aligned)
        self.free = []                  # free blocks, the most recently freed last
        self.owned = {}                 # id -> array handed out (a view of a block)
        self._block_of = {}             # id(array handed out) -> its block

    def take(self, shape, dtype):
        """A C-contiguous array of ``shape`` and ``dtype`` in a free block (the most
        recently freed one it fits in, within :data:`SLACK`), else in a new one."""
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        block = self._fitting(nbytes)
        if block is None:
            raw = np.empty(nbytes + ALIGN, np.uint8)
            start = -raw.ctypes.data % ALIGN
            block = raw[start:start + nbytes]
            self.blocks.append(block)
        a = block[:nbytes].view(dtype)[:nbytes // dtype.itemsize].reshape(shape)
        self.owned[id(a)] = a
        self._block_of[id(a)] = block
        return a

    def _fitting(self, nbytes):
        """Remove and return the free block to use for ``nbytes``, or None."""
        fits = [i for i in range(len(self.free) - 1, -1, -1) if self.free[i].size >= nbytes]
        if not fits:
            return None
        snug = [i for i in fits if self.free[i].size <= SLACK * nbytes]
        return self.free.pop((snug or fits)[0])

    def give(self, a, live):
        """Return ``a``'s block (if ``a`` is one of ours) unless a ``live`` array may
        share its memory."""
        if self.owned.get(id(a)) is not a:
            return
        if any(np.may_share_memory(v, a) for v in live):
            return
        del self.owned[id(a)]
        self.free.append(self._block_of.pop(id(a)))

    def holds(self, x):
        """Whether ``x`` may be (a view of) one of this pool's buffers."""
        return any(np.may_share_memory(x, b) for b in self.blocks)
