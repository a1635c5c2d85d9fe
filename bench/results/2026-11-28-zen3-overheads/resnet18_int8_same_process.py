import numpy as np, time, sys, tilegemm, onnxruntime as ort
from tilegemm.tools.zoo import MODELS
from tilegemm.tools.qmodel import quantize_model
threads=int(sys.argv[1]); batch=int(sys.argv[2]) if len(sys.argv)>2 else 1
tilegemm.set_num_threads(threads)
x=np.random.default_rng(0).standard_normal((batch,3,224,224)).astype(np.float32)
parties={}
for rr in (False, True):
    q=quantize_model(MODELS["resnet18"][0](),(batch,3,224,224),reduce_range=rr)
    net=tilegemm.load_onnx(q)
    so=ort.SessionOptions(); so.intra_op_num_threads=threads; so.add_session_config_entry("session.intra_op.allow_spinning","0")
    s=ort.InferenceSession(q.SerializeToString(), so, providers=["CPUExecutionProvider"])
    name=s.get_inputs()[0].name
    tag="7-bit" if rr else "int8"
    parties[f"tilegemm {tag}"]=lambda net=net: net(x)
    parties[f"onnxruntime {tag}"]=lambda s=s,name=name: s.run(None,{name:x})
    a=net(x); b=s.run(None,{name:x})[0]
    print(tag, "max rel diff", float(np.abs(a-b).max()/np.abs(b).max()), "top1 agree", float((a.argmax(1)==b.argmax(1)).mean()))
times={k:[] for k in parties}
for f in parties.values(): f(); f()
for r in range(15):
    for k,f in parties.items():
        t=time.perf_counter(); f(); times[k].append(time.perf_counter()-t)
for k,v in times.items(): print(f"{k:22s} best {min(v)*1e3:7.2f} ms  median {np.median(v)*1e3:7.2f} ms")
for tag in ("int8","7-bit"):
    print(tag, "ours/ORT speed (best)", round(min(times[f'onnxruntime {tag}'])/min(times[f'tilegemm {tag}']),2), "(median)", round(np.median(times[f'onnxruntime {tag}'])/np.median(times[f'tilegemm {tag}']),2))
