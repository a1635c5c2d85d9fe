"""Batched products in one launch: ``C[i] = A[i] @ B[i]`` over broadcast batch dimensions.

A Python loop over the batch costs one engine call per matrix (several
microseconds each), a hundred times the arithmetic of an 8x8 product.  Here the
batch is described once -- one flat array per operand, the strides every item
shares, and a table of each item's offsets -- and ``batch_tasks`` (in
``kernels/_tile.py``) runs the items in compiled code, threads taking chunks of
items from a shared counter.  Each item takes the unpacked path when its operands
fit the rule of :func:`~tilegemm.kernels.driver.fits_unpacked`, else the packed one.
"""
import collections
import math

import numpy as np

from tilegemm.ground.contracts import cdiv, round_up
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.validate import FLOAT_DTYPES
from tilegemm.ground.workspace import buffers, share_blocks
from tilegemm.kernels.driver import (fits_unpacked, gemm_into, k_block, serial_flops,
                                     unpacked_kc)
from tilegemm.kernels.pool import run_native_shares
from tilegemm.kernels.tiles import item_kernel
from tilegemm.kernels.tiny import BATCH_CALLS

#: Chunks of items per thread: threads take chunks from a counter, so a thread the
#: machine slows down takes fewer, while each chunk stays long enough that taking it
#: costs nothing next to its products.
CHUNKS_PER_THREAD = 8


def flat_nd(x):
    """``(flat, offset, strides)``: a 1-D view of the memory ``x`` spans (no copy), the
    position of ``x[0, ..., 0]`` in it and the strides in elements.

    The n-D form of :func:`tilegemm.packing.flat_view`: zero (broadcast) and
    negative strides are kept; strides that are not a multiple of the item size
    make a contiguous copy, so only operands that are read may have them.
    """
    item = x.itemsize
    if x.size == 0:
        return np.zeros(1, x.dtype), 0, (0,) * x.ndim
    if any(s % item for s in x.strides):
        x = np.ascontiguousarray(x)
    strides = tuple(s // item for s in x.strides)
    if x.flags.c_contiguous:
        return x.reshape(-1), 0, strides
    # Flip negatively strided axes so that base[0, ..., 0] is the lowest address.
    base = x[tuple(slice(None, None, -1) if s < 0 else slice(None) for s in strides)]
    lo = sum(s * (d - 1) for s, d in zip(strides, x.shape) if s < 0)
    span = sum(abs(s) * (d - 1) for s, d in zip(strides, x.shape)) + 1
    flat = np.lib.stride_tricks.as_strided(base, shape=(span,), strides=(item,),
                                           writeable=base.flags.writeable)
    return flat, -lo, strides


#: A thread is worth starting for this many items however small (8x8 float32 items run
#: at about 60 ns each: 2000 of them are 0.1 ms).
ITEMS_PER_SHARE = 2000

def batch_steps(x, strides, batch):
    """Per batch dimension of ``batch``, the stride of ``x`` in elements: 0 where ``x``
    lacks the dimension or has it of length 1 (broadcast), its own stride otherwise."""
    nb, own = len(batch), x.ndim - 2
    steps = [0] * nb
    for d in range(own):
        if x.shape[d] != 1:
            steps[nb - own + d] = strides[d]
    return steps


#: What :func:`route` may answer: each product of the batch in one launch on the
#: unpacked or the packed path, or (fewer products than threads, each worth sharing)
#: the products one after another, each shared by the threads.
BATCHED_ROUTES = ("batched_unpacked", "batched_packed", "batched_items")


def route(kern, count, shape, threads, b_strides):
    """How :func:`batched_into` runs ``count`` products of ``shape`` ``(m, n, k)`` on
    ``threads`` threads, B's items with ``b_strides`` (row, column): one of
    :data:`BATCHED_ROUTES`.  (The decision is :func:`choose_route`'s; this is the
    call of a launch, which tests wrap to note the path taken.)"""
    return choose_route(kern, count, shape, threads, b_strides)


def choose_route(kern, count, shape, threads, b_strides):
    """The route of :func:`route`, also asked once per shape by :func:`one_call_batch`."""
    m, n, k = shape
    # Items worth sharing, too few to go round evenly (3 items on 2 threads would
    # leave one thread a whole item behind): each item shared by the threads.
    if count < 4 * threads and 2 * m * n * k >= serial_flops(kern.dtype):
        return "batched_items"
    b_rs, b_cs = b_strides
    if b_cs == 1 and fits_unpacked(kern, m, n, k, b_rs):
        return "batched_unpacked"
    return "batched_packed"


def batch_shares(dtype, count, shape):
    """Shares of a batch worth a thread each: by flops as for one product, or by
    items, whose fixed cost (offsets, edge panels, a call of the loop) outweighs
    tiny products."""
    m, n, k = shape
    return max(int(2 * count * (2 * m * n * k) // serial_flops(dtype)), count // ITEMS_PER_SHARE)


def item_blocks(kern, blk, path, shape):
    """``(KC, blocks, sizes)`` of each item on ``path`` (``batched_unpacked`` or
    ``batched_packed``): its k block, the packed path's ``(KC, MC, NC)`` (None when
    unpacked) and the elements of its A and B scratch panels."""
    m, n, k = shape
    if path == "batched_unpacked":
        KC = unpacked_kc(kern, m, n, k)
        return KC, None, (kern.mr * KC, kern.nr * KC)
    KC = k_block(k, blk.kc)
    # Whole MR and NR panels: the blocking's MC and NC belong to its own tile, and
    # the packers fill whole panels.
    MC = min(round_up(blk.mc, kern.mr), round_up(m, kern.mr))
    NC = min(round_up(blk.nc, kern.nr), round_up(n, kern.nr))
    return KC, (KC, MC, NC), (MC * KC, NC * KC)


def batched_into(a, b, c, threads=None):
    """``c[i] = a[i] @ b[i]`` for every batch index ``i``, in one launch.

    Parameters
    ----------
    a, b : ndarray
        Validated operands of one float dtype, shapes ``(..., m, k)`` and ``(..., k,
        n)`` whose batch dimensions broadcast to ``c``'s, any strides.
    c : ndarray
        ``batch + (m, n)``, writeable, unit column stride and a row stride of whole
        elements, overlapping neither input.
    threads : int, optional
        Defaults to :func:`tilegemm.get_num_threads`.

    Returns
    -------
    c
    """
    batch = c.shape[:-2]
    m, k = a.shape[-2:]
    n = b.shape[-1]
    count = math.prod(batch)
    if count == 0 or m == 0 or n == 0:
        return c
    kern, blk = item_kernel(c.dtype, m, n)
    af, a0, a_st = flat_nd(a)
    bf, b0, b_st = flat_nd(b)
    cf, c0, c_st = flat_nd(c)
    b_rs, b_cs = b_st[-2:]
    if n == 1:
        b_cs = 1                          # one column: its stride is never used
    wanted = get_num_threads() if threads is None else threads
    path = route(kern, count, (m, n, k), wanted, (b_rs, b_cs))
    if path == "batched_items":
        # Fewer products than threads, each worth sharing: the threads split each one.
        a, b = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (a, b))
        for i in np.ndindex(*batch):
            gemm_into(a[i], b[i], c[i], threads=threads)
        return c
    steps = np.array([batch_steps(a, a_st, batch), batch_steps(b, b_st, batch),
                      batch_steps(c, c_st, batch)], np.int64).reshape(3, len(batch))
    threads = max(1, min(wanted, batch_shares(c.dtype, count, (m, n, k)), count))
    KC, blocks, sizes = item_blocks(kern, blk, path, (m, n, k))
    chunk = max(1, cdiv(count, threads * CHUNKS_PER_THREAD))
    plan = ((np.array(batch, np.int64), steps), (m, n, k), (af, (a0,) + a_st[-2:]),
            (bf, (b0, b_rs, b_cs)), (cf, (c0, c_st[-2], 1)), KC, blocks)

    # Native shares (kernels/native.py): the blocks hold addresses only, so this call
    # holds every array they name (the counter too) until the shares are done.
    mod = kern.shares
    total, a_len, b_len = mod.scratch_sizes(threads, *sizes)
    (scratch,) = buffers((kern.name, "batched"), (total,), kern.dtype)
    counter = np.zeros(1, np.int64)
    block, rows = share_blocks("batch", threads, mod.BATCH_SLOTS)
    mod.batch_blocks(block, counter, chunk, *plan, (scratch, a_len, b_len))
    run_native_shares(mod.share_address("batch" if blocks is None else "batch_packed"), rows)
    return c


#: A batch run by :func:`fast_batched`: ``call(a3, b3, c3, plan)`` is the kernel's
#: one-call entry (``kernels/_tile_batch.py``), ``rows`` the leading dimension of the
#: 3-D views (-1: the operand's batch, 1: its single item), ``path`` the route
#: taken, ``any_threads`` whether it stays on one thread whatever the thread count.
OneCallBatch = collections.namedtuple("OneCallBatch", "call plan shape rows path any_threads")


def fast_batched(a, b, out):
    """``a @ b`` for C-contiguous float ndarrays of one dtype and of as many dimensions
    (3 or more), batch dimensions equal or all 1 on one side, in one jitted call on
    this thread; None where that does not apply (other operands, a batch shared by
    threads, a product of a few large items, an ``out`` that is not C-contiguous).

    The general launch (:func:`batched_into`) spends tens of microseconds in Python
    describing strides and handing shares to threads; a batch that runs on one thread
    anyway needs none of it.  Each shape's plan is worked out once
    (``BATCH_CALLS``).  An ``out`` sharing memory with an operand is handled in the
    jitted call.
    """
    dtype = a.dtype
    if (b.dtype is not dtype or a.ndim < 3 or a.ndim != b.ndim or dtype not in FLOAT_DTYPES
            or not (a.flags.c_contiguous and b.flags.c_contiguous)):
        return None
    key = a.shape + b.shape + (dtype.itemsize,)
    entry = BATCH_CALLS.get(key)
    if entry is None:
        if len(BATCH_CALLS) >= 4096:             # bounded: shapes come and go
            BATCH_CALLS.clear()
        entry = BATCH_CALLS[key] = one_call_batch(dtype, a.shape, b.shape)
    if not (entry and (entry.any_threads or get_num_threads() == 1)):
        return None
    if out is None:
        out = np.empty(entry.shape, dtype)
    elif not (type(out) is np.ndarray and out.dtype is dtype and out.shape == entry.shape
              and out.flags.c_contiguous and out.flags.writeable):
        return None
    ra, rb = entry.rows
    if a.ndim == 3:
        entry.call(a, b, out, entry.plan)
    else:
        (m, k), n = a.shape[-2:], out.shape[-1]
        entry.call(a.reshape(ra, m, k), b.reshape(rb, k, n), out.reshape(-1, m, n), entry.plan)
    return out


def one_call_batch(dtype, a_shape, b_shape):
    """The :class:`OneCallBatch` of ``a_shape @ b_shape`` (as :func:`fast_batched`
    takes them), or False where the one-call path does not apply."""
    m, k = a_shape[-2:]
    n = b_shape[-1]
    a_items, b_items = math.prod(a_shape[:-2]), math.prod(b_shape[:-2])
    if b_shape[-2] != k or min(m, n, k) < 1:
        return False
    if a_shape[:-2] == b_shape[:-2] or b_items == 1:
        batch = a_shape[:-2]
    elif a_items == 1:
        batch = b_shape[:-2]
    else:
        return False
    count = math.prod(batch)
    if count < 1:
        return False
    kern, blk = item_kernel(dtype, m, n)
    path = choose_route(kern, count, (m, n, k), 1, (n, 1))
    if path == "batched_items":
        return False
    KC, blocks, _ = item_blocks(kern, blk, path, (m, n, k))
    module = kern.batches
    call, plan = ((module.matmul_batched, (KC, 0, 0)) if blocks is None
                  else (module.matmul_batched_packed, blocks))
    rows = tuple(1 if items == 1 else -1 for items in (a_items, b_items))
    return OneCallBatch(call, plan, batch + (m, n), rows, path,
                        batch_shares(dtype, count, (m, n, k)) <= 1)


def fast_route(a, b):
    """The route :func:`fast_batched` took for ``a @ b`` (for tests that note paths)."""
    return BATCH_CALLS[a.shape + b.shape + (a.dtype.itemsize,)].path
