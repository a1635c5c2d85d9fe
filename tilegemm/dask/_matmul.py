"""Products of dask arrays with tilegemm on each block pair and a tree sum over k."""
import numpy as np

import dask
import dask.array as da
from dask.utils import parse_bytes

import tilegemm
from tilegemm import tuning
from tilegemm.ground.contracts import cdiv, round_up
from tilegemm.ground.validate import check_threads
from tilegemm.dask import _worker

#: Partial products summed per node of the tree over the k blocks.
SPLIT_EVERY = 4


def task_memory_limit(task_memory=None):
    """Bytes one product task may hold (its A and B blocks and its product):
    ``task_memory`` (bytes or a string such as ``"512MiB"``), by default three of
    dask's ``array.chunk-size``."""
    if task_memory is None:
        return 3 * parse_bytes(dask.config.get("array.chunk-size"))
    limit = parse_bytes(task_memory) if isinstance(task_memory, str) else int(task_memory)
    if limit <= 0:
        raise ValueError(f"task_memory must be positive, got {task_memory!r}")
    return limit


def default_parallelism():
    """Task slots to fill: the threads of the distributed client's workers when
    there is one, else this machine's cores."""
    try:
        from distributed import default_client
        workers = default_client().scheduler_info()["workers"].values()
    except (ImportError, ValueError):
        return _worker.cores()
    # a cluster scaled to no workers yet: size for this machine's cores
    return sum(w["nthreads"] for w in workers) or _worker.cores()


def _chunks(extent, count, step):
    """``extent`` cut into ``count`` chunks rounded up to multiples of ``step``."""
    size = min(extent, round_up(cdiv(extent, count), step)) if extent else 0
    if size == 0:
        return (extent,)
    return (size,) * (extent // size) + ((extent % size,) if extent % size else ())


def matmul_chunks(m, n, k, dtype=np.float32, *, task_memory=None, parallelism=None):
    """Chunks for an (m x k) @ (k x n) product, from the blocking model.

    Rows come in multiples of MC, columns of NC and the k dimension of KC (the
    cache blocks of :func:`tilegemm.tuning.blocking`), so that every task runs
    whole cache blocks (where whole blocks cannot fit ``task_memory``, halves of
    them, down to whole register tiles), and a dimension's last chunk is at least 3/4 of the others
    unless they are down to one cache block (tasks of unequal size leave a worker
    idle at the end).  The largest dimension
    is cut first (m and n before k: a
    cut of k costs a pass to sum the partial products) until one task's A block,
    B block and product fit ``task_memory`` and there are at least
    ``parallelism`` blocks of C for the workers' threads to share.

    Returns
    -------
    tuple
        ``(m_chunks, n_chunks, k_chunks)``, each a tuple of ints as dask takes them.
    """
    b = tuning.blocking(np.dtype(dtype))
    itemsize = np.dtype(dtype).itemsize
    limit = task_memory_limit(task_memory)
    if parallelism is not None and (not isinstance(parallelism, (int, np.integer))
                                    or parallelism < 1):
        raise ValueError(f"parallelism must be a positive int, got {parallelism!r}")
    slots = parallelism or default_parallelism()
    extent = {"m": m, "n": n, "k": k}
    step = {"m": b.mc, "n": b.nc, "k": b.kc}
    tile = {"m": b.mr, "n": b.nr, "k": 16}     # the finest step: whole register tiles
    count = {"m": 1, "n": 1, "k": 1}

    def size(d):
        return max(c for c in _chunks(extent[d], count[d], step[d]))

    def balanced(d):         # a last chunk of at least 3/4 of the others
        chunks = _chunks(extent[d], count[d], step[d])
        return len(chunks) == 1 or 4 * chunks[-1] >= 3 * chunks[0]

    def split(d):            # the next count that makes the chunks smaller and even
        before = size(d)
        count[d] += 1
        while not (size(d) < before and (balanced(d) or size(d) <= step[d])):
            count[d] += 1

    while True:
        sm, sn, sk = size("m"), size("n"), size("k")
        fits = itemsize * (sm * sk + sk * sn + sm * sn) <= limit
        enough = (len(_chunks(m, count["m"], step["m"]))
                  * len(_chunks(n, count["n"], step["n"])) >= slots)
        cuttable = [d for d in ("m", "n", "k") if size(d) > step[d] and (fits is False or d != "k")]
        if fits and enough:
            break
        if not cuttable:
            # Whole cache blocks cannot fit the task's memory (a large L2 makes NC
            # thousands of columns): the largest dimension's step halves, down to
            # whole register tiles.
            finer = [d for d in ("m", "n", "k") if not fits and step[d] > tile[d]]
            if not finer:
                break
            d = max(finer, key=size)
            step[d] = max(tile[d], step[d] // 2 // tile[d] * tile[d])
            continue
        split(max(cuttable, key=size))
    return tuple(_chunks(extent[d], count[d], step[d]) for d in ("m", "n", "k"))


def _dtype(a, b):
    """The result dtype, with tilegemm.matmul's rule (float32 or float64 only)."""
    for name, x in (("a", a), ("b", b)):
        if x.dtype not in (np.float32, np.float64):
            raise TypeError(f"tilegemm.dask.matmul: {name} has dtype {x.dtype}; "
                            "float32 and float64 are supported")
    return np.result_type(a.dtype, b.dtype)


def _as_dask(x, name):
    if isinstance(x, da.Array):
        return x
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"tilegemm.dask.matmul: {name} is a scalar; matmul needs arrays")
    return da.from_array(x, chunks=x.shape)


def _batch_chunks(x, items):
    """Chunks of ``x``'s batch axes holding about ``items`` products a task: the
    last batch axis in runs of ``items``, the others one at a time."""
    batch = x.ndim - 2
    return {axis: (1 if axis < batch - 1 else min(items, max(1, x.shape[axis])))
            for axis in range(batch)}


def _rechunked(a, b, rechunk, task_memory, dtype):
    """A and B with the product's chunks: the blocking model's with ``rechunk``
    (batch axes cut so that a task's items fit ``task_memory`` too), else B follows
    A's chunks along k (mismatched k chunks are rechunked)."""
    if rechunk:
        mc, nc, kc = matmul_chunks(a.shape[-2], b.shape[-1], a.shape[-1], dtype,
                                   task_memory=task_memory)
        itemsize = np.dtype(dtype).itemsize
        item = itemsize * (mc[0] * kc[0] + kc[0] * nc[0] + mc[0] * nc[0])
        items = max(1, task_memory_limit(task_memory) // max(1, item))
        return (a.rechunk({**_batch_chunks(a, items), a.ndim - 2: mc, a.ndim - 1: kc}),
                b.rechunk({**_batch_chunks(b, items), b.ndim - 2: kc, b.ndim - 1: nc}))
    if a.chunks[-1] != b.chunks[-2]:
        b = b.rechunk({b.ndim - 2: a.chunks[-1]})
    return a, b


def _product(a, b, threads):
    """One task: tilegemm.matmul of a block pair."""
    return _worker.run(threads, tilegemm.matmul, a, b)


def _block_product(a, b, threads):
    """One task of a product with several k blocks: its part, with a k axis of one."""
    return _product(a, b, threads)[..., None, :, :]


def _block_sum(parts, axis=None, keepdims=False, **_):
    """Sum of partial products (each with a k axis of length 1), in one new array."""
    if isinstance(parts, list):
        total = parts[0] + parts[1] if len(parts) > 1 else parts[0].copy()
        for part in parts[2:]:
            np.add(total, part, out=total)
    else:
        total = parts
    return total if keepdims else total.squeeze(axis)


def _contract(a, b, dtype, threads, split_every):
    """blockwise over (batch, i, j) for every k block, then a tree sum over k."""
    nd = max(a.ndim, b.ndim)
    batch = tuple(range(nd - 2))
    i, j, kk = nd - 2, nd - 1, nd
    a_ind = batch[nd - a.ndim:] + (i, kk)
    b_ind = batch[nd - b.ndim:] + (kk, j)
    if len(a.chunks[-1]) == 1:              # one k block: no sum
        return da.blockwise(_product, batch + (i, j), a, a_ind, b, b_ind, threads=threads,
                            dtype=dtype, concatenate=True)
    parts = da.blockwise(_block_product, batch + (kk, i, j), a, a_ind, b, b_ind,
                         threads=threads, adjust_chunks={kk: 1}, dtype=dtype)
    return da.reduction(parts, _block_sum, _block_sum, combine=_block_sum, axis=nd - 2,
                        concatenate=False, split_every=split_every, dtype=dtype,
                        meta=np.empty((0,) * nd, dtype=dtype))


def matmul(a, b, *, rechunk=False, task_memory=None, threads=None, split_every=SPLIT_EVERY):
    """``a @ b`` for dask arrays, tilegemm computing every block product.

    Parameters
    ----------
    a, b : dask.array.Array or array_like
        float32/float64 operands with numpy matmul's shapes (1-D operands, leading
        batch dimensions that broadcast).  numpy operands are wrapped as one chunk
        (give ``rechunk=True`` to cut them).
    rechunk : bool
        Cut the last two dimensions of both operands into the chunks of
        :func:`matmul_chunks` (cache-block multiples, bounded by ``task_memory``),
        and batch dimensions into as many items a task as fit ``task_memory``,
        instead of keeping the callers'.  When False, B's chunks along k are made
        A's if they differ.
    task_memory : int or str, optional
        Bytes one task may hold with ``rechunk`` (default three of dask's
        ``array.chunk-size``).
    threads : int, optional
        tilegemm threads per task (default: the worker's share of its cores,
        see :func:`set_worker_threads`).
    split_every : int
        Partial products summed per task of the tree over the k blocks.

    Returns
    -------
    dask.array.Array
        Lazy; ``.compute()`` runs it on the current scheduler.

    Raises
    ------
    TypeError
        An operand that is not float32 or float64.
    ValueError
        Scalars, mismatched inner dimensions or batch dimensions that do not broadcast.
    """
    a, b = _as_dask(a, "a"), _as_dask(b, "b")
    dtype = _dtype(a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("tilegemm.dask.matmul: scalar operands; matmul needs arrays")
    for name, x in (("a", a), ("b", b)):
        if any(np.isnan(extent) for extent in x.shape):
            raise ValueError(f"tilegemm.dask.matmul: {name}'s chunk sizes are unknown (shape "
                             f"{x.shape}); call compute_chunk_sizes() first")
    if isinstance(split_every, bool) or not isinstance(split_every, (int, np.integer)) \
            or split_every < 2:
        raise ValueError(f"tilegemm.dask.matmul: split_every must be an int >= 2, "
                         f"got {split_every!r}")
    threads = check_threads(threads, "tilegemm.dask.matmul")
    if task_memory is not None:
        task_memory_limit(task_memory)
    vector_a, vector_b = a.ndim == 1, b.ndim == 1
    a = a[None, :] if vector_a else a
    b = b[:, None] if vector_b else b
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"tilegemm.dask.matmul: shapes {a.shape} and {b.shape} do not "
                         f"match: {a.shape[-1]} (a's last) != {b.shape[-2]} (b's second last)")
    try:
        np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"tilegemm.dask.matmul: batch dimensions of {a.shape} and "
                         f"{b.shape} do not broadcast") from None
    a, b = _rechunked(a, b, rechunk, task_memory, dtype)
    c = _contract(a.astype(dtype), b.astype(dtype), dtype, threads, int(split_every))
    if vector_a:
        c = c[..., 0, :]
    if vector_b:
        c = c[..., 0]
    return c
