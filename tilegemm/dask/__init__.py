"""tilegemm as the block kernel of dask arrays (``pip install 'tilegemm[dask]'``).

dask splits, places and moves the blocks; tilegemm computes each one:

* :func:`matmul` -- a product of dask arrays: tilegemm on every block pair, a tree
  sum over the k blocks, chunks from the blocking model with ``rechunk=True``
  (:func:`matmul_chunks`);
* :func:`conv2d` -- a convolution of a dask array of images chunked along the batch
  (and over the image, each chunk read with the halo its windows need), the
  prepared weights built once per worker process;
* :func:`run_network` -- batch chunks through a :class:`tilegemm.Network`, loaded
  once per worker process;
* :func:`set_worker_threads` -- each worker's tilegemm threads per task, so that
  they times the worker threads never exceed the host's cores.

The core of tilegemm never imports dask; this module needs ``dask[array]``, and
``distributed`` for a cluster.
"""
try:
    import dask.array  # noqa: F401
except ImportError as error:              # pragma: no cover - depends on the install
    raise ImportError("tilegemm.dask needs dask: pip install 'tilegemm[dask]' "
                      "(dask[array] and distributed)") from error

from tilegemm.dask._conv import conv2d, run_network
from tilegemm.dask._matmul import matmul, matmul_chunks
from tilegemm.dask._worker import set_worker_threads, task_threads, worker_builds

__all__ = ["matmul", "matmul_chunks", "conv2d", "run_network", "set_worker_threads",
           "task_threads", "worker_builds"]
