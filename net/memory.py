"""Activation buffers reused by liveness, in one compact arena.

A network's first run on an input shape records the shape and dtype of every step's
outputs; later runs of that shape take each output's buffer from this thread's
arena and give it back after the tensor's last reader, so a steady-state run
allocates no activations but its outputs (what numpy allocates inside a step aside:
a Pad).  Buffers belong to one calling thread (a :class:`Buffers` per thread and
shape), so concurrent calls never share one.

A tensor takes the lowest free stretch of the arena it fits in, as an inference
runtime's memory plan places it: the same few megabytes are written and read again
layer after layer and stay in cache.  Buffers kept per shape (each reused once a
run, after the whole network's activations and weights went past) made MobileNetV2's
112x112x96 expansion write 4.8 MB into lines evicted to memory, 1.4x slower than into
cached ones; blocks reused whole, the most recently freed first, left its large
tensors in blocks of their own, touched once a run.
"""
import bisect

import numpy as np

#: Alignment of every buffer: a cache line, and a whole vector on every ISA.
ALIGN = 64
#: A new chunk of the arena holds at least this many times the tensor that needs it
#: (the first is sized from the largest tensor the run records), so that the tensors
#: live together fit in one chunk and reuse its low addresses.
CHUNK_TENSORS = 3


class Buffers:
    """An arena of chunks handed out as arrays, for one input shape and thread.

    Parameters
    ----------
    reserve : int, optional
        Bytes of the first chunk (made on the first ``take``).
    """

    def __init__(self, reserve=0):
        self.reserve = int(reserve)
        self.chunks = []                # uint8 arrays, ALIGN-aligned
        self.free = []                  # per chunk: sorted [start, end) free stretches
        self.owned = {}                 # id -> array handed out
        self._where = {}                # id(array handed out) -> (chunk, start, end)

    def take(self, shape, dtype):
        """A C-contiguous array of ``shape`` and ``dtype``: the lowest free stretch of
        the arena that holds it, in a new chunk if none does."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = -(-max(1, count * dtype.itemsize) // ALIGN) * ALIGN
        found = self._first_fit(nbytes)
        if found is None:
            found = self._new_chunk(nbytes), 0
        chunk, start = found
        a = self.chunks[chunk][start:start + count * dtype.itemsize].view(dtype).reshape(shape)
        self.owned[id(a)] = a
        self._where[id(a)] = (chunk, start, start + nbytes)
        return a

    def _first_fit(self, nbytes):
        """``(chunk, start)`` of the lowest free stretch of ``nbytes`` or more, taken
        out of the free list; None if no chunk has one."""
        for chunk, stretches in enumerate(self.free):
            for i, (start, end) in enumerate(stretches):
                if end - start >= nbytes:
                    if end - start == nbytes:
                        del stretches[i]
                    else:
                        stretches[i] = (start + nbytes, end)
                    return chunk, start
        return None

    def _new_chunk(self, nbytes):
        size = max(nbytes * CHUNK_TENSORS, self.reserve if not self.chunks else 0)
        size = -(-size // ALIGN) * ALIGN
        raw = np.empty(size + ALIGN, np.uint8)
        start = -raw.ctypes.data % ALIGN
        self.chunks.append(raw[start:start + size])
        self.free.append([(nbytes, size)] if size > nbytes else [])
        return len(self.chunks) - 1

    def give(self, a, live):
        """Return ``a``'s stretch (if ``a`` is one of ours) unless a ``live`` array may
        share its memory; free neighbours merge."""
        if self.owned.get(id(a)) is not a:
            return
        if any(np.may_share_memory(v, a) for v in live):
            return
        del self.owned[id(a)]
        chunk, start, end = self._where.pop(id(a))
        stretches = self.free[chunk]
        i = bisect.bisect(stretches, (start, end))
        if i < len(stretches) and stretches[i][0] == end:      # merge with the next
            end = stretches.pop(i)[1]
        if i > 0 and stretches[i - 1][1] == start:             # and with the previous
            start = stretches.pop(i - 1)[0]
            i -= 1
        stretches.insert(i, (start, end))

    def holds(self, x):
        """Whether ``x`` may be (a view of) one of this pool's buffers."""
        return any(np.may_share_memory(x, c) for c in self.chunks)
