import numpy as np, time, sys, tilegemm
from threadpoolctl import threadpool_limits
rng=np.random.default_rng(0)
def tm(f, r=21):
    f(); best=1e9
    for _ in range(r):
        t=time.perf_counter(); f(); best=min(best, time.perf_counter()-t)
    return best*1e3
for threads in (1, 2):
    tilegemm.set_num_threads(threads)
    for dt in (np.float32,):
        for N,s in [(10000,8),(4000,16),(1000,32),(256,64),(64,128)]:
            a=rng.random((N,s,s)).astype(dt); b=rng.random((N,s,s)).astype(dt)
            time.sleep(0.3); t1=tm(lambda: tilegemm.matmul(a,b))
            with threadpool_limits(threads, user_api="blas"):
                time.sleep(0.3); tn=tm(lambda: np.matmul(a,b))
            print(f"t{threads} {N}x{s}^3 tg {t1:.3f} ms  np {tn:.3f} ms  x{tn/t1:.2f}", flush=True)
