"""Square products, tilegemm against numpy in the same process.

Usage: python squares.py THREADS DTYPE N... -- numpy's BLAS limited to the same
thread count (threadpoolctl); best of 7 samples of at least 0.1 s each, tilegemm and
numpy alternated twice.
"""
import numpy as np, time, sys, tilegemm
from threadpoolctl import threadpool_limits
T=int(sys.argv[1]); dt=np.dtype(sys.argv[2]); sizes=[int(x) for x in sys.argv[3:]]
tilegemm.set_num_threads(T)
def best(f, reps=7):
    f(); t=time.perf_counter(); f(); one=time.perf_counter()-t
    inner=max(1,int(0.1/max(one,1e-7))); bb=1e9
    for _ in range(reps):
        t=time.perf_counter()
        for _ in range(inner): f()
        bb=min(bb,(time.perf_counter()-t)/inner)
    return bb
rng=np.random.default_rng(0)
with threadpool_limits(T, user_api="blas"):
  for n in sizes:
    a=rng.standard_normal((n,n)).astype(dt); b=rng.standard_normal((n,n)).astype(dt); c=np.empty((n,n),dt)
    o=[];p=[]
    for _ in range(2):
        o.append(best(lambda: tilegemm.matmul(a,b,out=c))); p.append(best(lambda: np.matmul(a,b,out=c)))
    t1,t2=min(o),min(p)
    print(f"{T}T {dt.name} {n:5d}: ours {t1*1e6:9.1f} us ({2*n**3/t1/1e9:6.1f} GF) numpy {t2*1e6:9.1f} us ({2*n**3/t2/1e9:6.1f} GF) ratio {t2/t1:.2f}", flush=True)
