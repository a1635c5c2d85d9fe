# Per-call time of tilegemm.gemm / matmul against numpy for small square float32 products.
# Run: python per-call.py LABEL (prints min/median microseconds over 3000 calls).
import time, numpy as np, tilegemm, sys
def best(f,r=3000):
    ts=[]
    for _ in range(r):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return min(ts)*1e6, np.median(ts)*1e6
for n in (4,16,32,64,128):
    a=np.random.rand(n,n).astype(np.float32); b=np.random.rand(n,n).astype(np.float32); c=np.empty((n,n),np.float32)
    tilegemm.gemm(a,b); tilegemm.gemm(a,b,c)
    r=[best(lambda: tilegemm.gemm(a,b)), best(lambda: tilegemm.gemm(a,b,c)), best(lambda: tilegemm.matmul(a,b)), best(lambda: np.matmul(a,b))]
    print(sys.argv[1], n, "gemm %.1f/%.1f  gemm(c) %.1f/%.1f  matmul %.1f/%.1f  numpy %.1f/%.1f us (min/med)"%sum(r,()))
