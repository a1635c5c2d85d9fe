"""The peers a network is timed against: onnxruntime on the same ONNX model, and torch
running the same optimized graph with its own operators (oneDNN/MKL convolutions),
each when installed and never required.

Each peer is a callable ``peer(x) -> output`` with a ``name``; a peer that cannot run
the model says why (``unavailable``) instead of being timed.
"""
import numpy as np


class Unavailable(Exception):
    """A peer that is not installed or cannot run this model (the message says which)."""


def onnxruntime_peer(model_bytes, input_name, threads):
    """onnxruntime's CPU session on the model, ``threads`` intra-op threads."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise Unavailable("onnxruntime is not installed (pip install onnxruntime)") from None
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])

    def run(x):
        return session.run(None, {input_name: x})[0]
    run.name = "onnxruntime"
    return run


def torch_peer(graph, threads):
    """torch running ``graph`` (tilegemm's optimized graph: BatchNorm folded, epilogues
    fused) op by op with ``torch.nn.functional``, under ``inference_mode``."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        raise Unavailable("torch is not installed") from None
    torch.set_num_threads(threads)
    constants = {k: torch.from_numpy(np.array(v)) for k, v in graph.constants.items()}  # writable
    acts = {None: lambda y: y, "relu": torch.relu, "relu6": lambda y: torch.clamp(y, 0, 6)}
    unknown = sorted({n.op for n in graph.nodes} - set(_TORCH_OPS))
    if unknown:
        raise Unavailable(f"torch peer: operators {unknown} are not mapped")

    def run(x):
        values = dict(constants)
        values[graph.inputs[0].name] = torch.from_numpy(x)
        with torch.inference_mode():
            for node in graph.nodes:
                args = [values[n] if n else None for n in node.inputs]
                values[node.outputs[0]] = _TORCH_OPS[node.op](F, acts, node, *args)
        return values[graph.outputs[0]].numpy()
    run.name = "torch"
    return run


def _conv(F, acts, node, x, w, b=None, residual=None):
    t, left, bottom, right = node.attrs.get("pads", (0, 0, 0, 0))
    if node.attrs.get("auto_pad", "NOTSET") != "NOTSET" or (t, left) != (bottom, right):
        raise Unavailable("torch peer: auto_pad or uneven pads")
    y = F.conv2d(x, w, b, node.attrs.get("strides", (1, 1)), (t, left),
                 node.attrs.get("dilations", (1, 1)), node.attrs.get("group", 1))
    if residual is not None:
        y = y + residual
    return acts[node.epilogue.get("activation")](y)


def _pool(F, acts, node, x):
    t, left, bottom, right = node.attrs.get("pads", (0, 0, 0, 0))
    kw = dict(kernel_size=node.attrs["kernel_shape"], stride=node.attrs.get("strides", 1),
              padding=(t, left), ceil_mode=bool(node.attrs.get("ceil_mode", 0)))
    if node.op == "MaxPool":
        return F.max_pool2d(x, dilation=node.attrs.get("dilations", 1), **kw)
    return F.avg_pool2d(x, count_include_pad=bool(node.attrs.get("count_include_pad", 0)), **kw)


def _gemm(F, acts, node, a, b, c=None):
    a = a.T if node.attrs.get("transA", 0) else a
    b = b.T if node.attrs.get("transB", 0) else b
    y = node.attrs.get("alpha", 1.0) * (a @ b)
    if c is not None:
        y = y + node.attrs.get("beta", 1.0) * c
    return acts[node.epilogue.get("activation")](y)


_TORCH_OPS = {
    "Conv": _conv, "MaxPool": _pool, "AveragePool": _pool, "Gemm": _gemm,
    "GlobalAveragePool": lambda F, acts, node, x: x.mean(dim=(2, 3), keepdim=True),
    "Flatten": lambda F, acts, node, x: x.flatten(node.attrs.get("axis", 1)),
    "Relu": lambda F, acts, node, x: acts["relu"](x),
    "Clip": lambda F, acts, node, x, lo=None, hi=None: x.clamp(
        None if lo is None else float(lo), None if hi is None else float(hi)),
    "Add": lambda F, acts, node, a, b: a + b,
    "Dropout": lambda F, acts, node, x, *rest: x,
    "Identity": lambda F, acts, node, x: x,
    "Softmax": lambda F, acts, node, x: x.softmax(node.attrs.get("axis", -1)),
}
