import numpy as np, time, tilegemm, sys, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tilegemm.tools import qconv_suite as qs
tilegemm.set_num_threads(1)
batch=int(sys.argv[2]) if len(sys.argv)>2 else 1
res={}
for layer in sys.argv[1].split(","):
    case=qs.QConvCase(layer,"NHWC",1,batch,"7-bit")
    q=qs.operands(case); ly=case.spec; ho,wo=ly.out_hw
    bias_q=np.rint(q["bias"].astype(np.float64)/(float(q["x_scale"])*q["w_scale"].astype(np.float64))).astype(np.int32)
    consts={"x_scale":np.float32(q["x_scale"]),"x_zero_point":np.uint8(qs.X_ZERO_POINT),"w":q["w"],"w_scale":q["w_scale"],"w_zero_point":np.zeros(ly.k,np.int8),"y_scale":q["out_scale"],"y_zero_point":q["out_zero_point"],"B":bias_q}
    node=helper.make_node("QLinearConv",["x"]+list(consts),["y"],domain="com.microsoft",channels_last=1,kernel_shape=[ly.kh,ly.kw],strides=[ly.stride]*2,pads=[ly.padding]*4,group=ly.groups)
    g=helper.make_graph([node],"g",[helper.make_tensor_value_info("x",TensorProto.UINT8,[batch,ly.h,ly.w,ly.c])],[helper.make_tensor_value_info("y",TensorProto.UINT8,[batch,ho,wo,ly.k])],initializer=[numpy_helper.from_array(np.asarray(v),n) for n,v in consts.items()])
    m=helper.make_model(g,opset_imports=[helper.make_opsetid("",13),helper.make_opsetid("com.microsoft",1)])
    so=ort.SessionOptions(); so.intra_op_num_threads=1; so.add_session_config_entry("session.intra_op.allow_spinning","0")
    s=ort.InferenceSession(m.SerializeToString(),so,providers=["CPUExecutionProvider"])
    xh=np.ascontiguousarray(q["x"].transpose(0,2,3,1))
    qw=tilegemm.QConvWeights(q["w"], q["w_scale"].astype(np.float64))
    kw=dict(x_zero_point=qs.X_ZERO_POINT,padding=ly.padding,stride=ly.stride,groups=ly.groups,out_scale=q["out_scale"],out_zero_point=q["out_zero_point"],layout="NHWC")
    ours=lambda: tilegemm.qconv2d(xh,q["x_scale"],qw,None,q["bias"],**kw)
    theirs=lambda: s.run(None,{"x":xh})[0]
    d=np.abs(ours().astype(int)-theirs().astype(int)).max()
    T={"ours":[],"ort":[]}
    for i in range(30):
        for k,f in (("ours",ours),("ort",theirs)):
            t=time.perf_counter(); f(); T[k].append(time.perf_counter()-t)
    print(f"{layer} b{batch} NHWC ours {min(T['ours'])*1e3:.3f} ms ({case.ops/min(T['ours'])/1e9:.0f} GOPS)  ORT nhwc {min(T['ort'])*1e3:.3f} ms ({case.ops/min(T['ort'])/1e9:.0f})  ratio {min(T['ort'])/min(T['ours']):.2f}  maxdiff {d}")
