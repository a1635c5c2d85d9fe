"""Batched and single small products, tilegemm against numpy in the same process.

Usage: python batched.py THREADS -- numpy's BLAS limited to the same thread count
(threadpoolctl); each row alternates the two parties twice, best of 7 samples of
at least 50 ms each.
"""
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

import tilegemm

ROWS = ((10000, 8), (4000, 16), (1000, 32), (256, 64), (64, 128), (1, 4), (1, 16), (1, 32),
        (1, 64))


def best(f, reps=7):
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
    print(f"threads {threads}; {tilegemm.__name__} matmul(a, b, out=c) against numpy.matmul")
    with threadpool_limits(threads, user_api="blas"):
        for dtype in (np.float32, np.float64):
            for count, n in ROWS:
                shape = (count, n, n) if count > 1 else (n, n)
                a = rng.standard_normal(shape).astype(dtype)
                b = rng.standard_normal(shape).astype(dtype)
                c = np.empty_like(a)
                ours, theirs = [], []
                for _ in range(2):
                    ours.append(best(lambda: tilegemm.matmul(a, b, out=c)))
                    theirs.append(best(lambda: np.matmul(a, b, out=c)))
                t1, t2 = min(ours), min(theirs)
                print(f"{np.dtype(dtype).name:8s} {count:6d} x {n:3d}^3  tilegemm {t1 * 1e6:9.1f} us"
                      f"  numpy {t2 * 1e6:9.1f} us  ratio {t2 / t1:.2f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
