import time, numpy as np, threading, tilegemm
n=512
rng=np.random.default_rng(0)
a=rng.random((n,n),np.float32); b=rng.random((n,n),np.float32); ref=a.astype(np.float64)@b
count=[0]; bad=[0]
def work():
    end=time.time()+4
    while time.time()<end:
        c=tilegemm.matmul(a,b)
        pass
        count[0]+=1
ths=[threading.Thread(target=work) for _ in range(6)]
t=time.time(); [x.start() for x in ths]; [x.join() for x in ths]
assert np.allclose(tilegemm.matmul(a,b), ref, rtol=1e-4)
print("calls", count[0], "bad", bad[0], "GFLOPS %.1f"%(count[0]*2*n**3/(time.time()-t)/1e9))
