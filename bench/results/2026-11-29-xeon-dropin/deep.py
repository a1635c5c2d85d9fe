"""Deep products of small m and n (k much larger), tilegemm against numpy in the same
process.

Usage: python deep.py THREADS -- numpy's BLAS limited to the same thread count
(threadpoolctl); best of 5 samples of at least 50 ms each, tilegemm and numpy
alternated twice.
"""
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

import tilegemm

SHAPES = ((32, 32, 32768), (64, 64, 32768), (16, 16, 65536), (48, 48, 20000),
          (32, 64, 30000), (64, 64, 4096), (20, 50, 40000), (64, 64, 1024))


def best(f, reps=5):
    f()
    t = time.perf_counter()
    f()
    one = time.perf_counter() - t
    inner = max(1, int(0.05 / max(one, 1e-7)))
    b = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            f()
        b = min(b, (time.perf_counter() - t) / inner)
    return b


def main(threads):
    tilegemm.set_num_threads(threads)
    rng = np.random.default_rng(0)
    print(f"threads {threads}; tilegemm matmul(a, b, out=c) against numpy.matmul")
    with threadpool_limits(threads, user_api="blas"):
        for dtype in (np.float32, np.float64):
            for m, n, k in SHAPES:
                a = rng.standard_normal((m, k)).astype(dtype)
                b = rng.standard_normal((k, n)).astype(dtype)
                c = np.empty((m, n), dtype)
                ours, theirs = [], []
                for _ in range(2):
                    ours.append(best(lambda: tilegemm.matmul(a, b, out=c)))
                    theirs.append(best(lambda: np.matmul(a, b, out=c)))
                t1, t2 = min(ours), min(theirs)
                print(f"{np.dtype(dtype).name:8s} {m}x{n}x{k:<6d} tilegemm {t1 * 1e6:8.0f} us"
                      f"  numpy {t2 * 1e6:8.0f} us  ratio {t2 / t1:.2f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
