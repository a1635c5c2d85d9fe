"""The elementwise and shape operators of a network (convolution, pooling and the
matrix products are in :mod:`tilegemm.net.layers`), registered by ONNX type with
:func:`tilegemm.net.registry.operator`.
"""
import numpy as np

from tilegemm.net.registry import operator, unsupported

#: The layouts of :mod:`tilegemm.net.layers`; elementwise operators run in either.
EITHER = ("NCHW", "NHWC")


def elementwise(fn):
    """Mark ``fn`` as running unchanged in any layout (its operands must then share
    one: the layout plan checks their shapes)."""
    fn.layouts = {layout: fn for layout in EITHER}
    fn.elementwise = True
    return fn


def writes_into(fn):
    """Mark ``fn`` as taking ``out=[array per output]`` to write its results into
    (buffers the network reuses); every layout's function must take it too."""
    for f in {id(f): f for f in getattr(fn, "layouts", {}).values()}.values():
        f.writes_into = True
    fn.writes_into = True
    return fn


def first(out):
    """The first array of ``out`` (a list of output buffers), or None."""
    return None if out is None else out[0]


# --------------------------------------------------------------------------- activations
def relu(x, out=None):
    return np.maximum(x, x.dtype.type(0), out=out)        # NaN stays NaN


def clip(x, lo, hi, out=None):
    """``x`` clipped to [lo, hi] (either may be None); NaN stays NaN."""
    if lo is None and hi is None:
        if out is None:
            return x.copy()
        np.copyto(out, x)
        return out
    y = x if lo is None else np.maximum(x, lo.astype(x.dtype), out=out)
    return y if hi is None else np.minimum(y, hi.astype(x.dtype), out=out)


def sigmoid(x):
    return np.exp(-np.logaddexp(0, -x)).astype(x.dtype, copy=False)    # no overflow


def hard_sigmoid(x, alpha=0.2, beta=0.5):
    return np.minimum(np.maximum(x * x.dtype.type(alpha) + x.dtype.type(beta), 0), 1)


def hard_swish(x):
    return x * hard_sigmoid(x, 1 / 6, 0.5)


@operator("Relu")
def _relu(node, const):
    return writes_into(elementwise(lambda x, out=None: (relu(x, first(out)),)))


@operator("Clip")
def _clip(node, const):
    return writes_into(elementwise(lambda x, lo=None, hi=None, out=None:
                                   (clip(x, lo, hi, first(out)),)))


@operator("LeakyRelu", ("alpha",))
def _leaky_relu(node, const):
    alpha = node.attrs.get("alpha", 0.01)
    return elementwise(lambda x: (np.where(x < 0, x * x.dtype.type(alpha), x),))


@operator("Sigmoid")
def _sigmoid(node, const):
    return elementwise(lambda x: (sigmoid(x),))


@operator("HardSigmoid", ("alpha", "beta"))
def _hard_sigmoid(node, const):
    alpha, beta = node.attrs.get("alpha", 0.2), node.attrs.get("beta", 0.5)
    return elementwise(lambda x: (hard_sigmoid(x, alpha, beta),))


@operator("HardSwish")
def _hard_swish(node, const):
    return elementwise(lambda x: (hard_swish(x),))


@operator("Softmax", ("axis",))
def _softmax(node, const):
    axis = node.attrs.get("axis", -1)

    def softmax(x):
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return (e / np.sum(e, axis=axis, keepdims=True),)
    return softmax


# --------------------------------------------------------------------------- arithmetic
for _name, _ufunc in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply),
                      ("Div", np.divide)):
    def _binary(node, const, ufunc=_ufunc):
        # numpy broadcasting is ONNX's
        return writes_into(elementwise(lambda a, b, out=None: (ufunc(a, b, out=first(out)),)))
    operator(_name)(_binary)


@operator("Identity")
def _identity(node, const):
    return elementwise(lambda x: (x,))


@operator("Dropout", ("seed",))
def _dropout(node, const):
    """Inference: the input unchanged (and an all-true mask when asked for)."""
    if len(node.inputs) > 2 and node.inputs[2]:
        training = const(node.inputs[2])
        if training is None or bool(training):
            raise unsupported(node, "training_mode must be a constant false (inference only)")
    return elementwise(lambda x, *rest: (x, np.ones(x.shape, bool)))


@operator("Cast", ("to", "saturate"))
def _cast(node, const):
    from onnx.helper import tensor_dtype_to_np_dtype
    dtype = np.dtype(tensor_dtype_to_np_dtype(node.attrs["to"]))
    return lambda x: (np.asarray(x).astype(dtype),)


# --------------------------------------------------------------------------- shapes
@operator("Shape", ("start", "end"))
def _shape(node, const):
    start, end = node.attrs.get("start", 0), node.attrs.get("end")
    return lambda x: (np.array(x.shape[start:end], np.int64),)


@operator("Gather", ("axis",))
def _gather(node, const):
    axis = node.attrs.get("axis", 0)
    return lambda data, indices: (np.take(data, indices.astype(np.int64), axis=axis),)


def _axes(axes, rank):
    return sorted(int(a) % rank for a in np.ravel(axes))


@operator("Unsqueeze")
def _unsqueeze(node, const):
    def unsqueeze(x, axes):
        x = np.asarray(x)
        return (np.expand_dims(x, tuple(_axes(axes, x.ndim + np.size(axes)))),)
    return unsqueeze


@operator("Squeeze")
def _squeeze(node, const):
    def squeeze(x, axes=None):
        x = np.asarray(x)
        return (np.squeeze(x, None if axes is None else tuple(_axes(axes, x.ndim))),)
    return squeeze


@operator("Concat", ("axis",))
def _concat(node, const):
    axis = node.attrs["axis"]

    def along(a):
        return lambda *xs, out=None: (np.concatenate(xs, axis=a, out=first(out)),)
    concat = along(axis)
    if axis == 1:              # channels: the last axis of NHWC
        concat.layouts = {"NCHW": concat, "NHWC": along(3)}
    return writes_into(concat)


@operator("Flatten", ("axis",))
def _flatten(node, const):
    axis = node.attrs.get("axis", 1)

    def flatten(x):
        a = axis % x.ndim if axis < 0 else axis
        return (x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), -1),)
    return flatten


@operator("Reshape", ("allowzero",))
def _reshape(node, const):
    allowzero = node.attrs.get("allowzero", 0)

    def reshape(x, shape):
        shape = [int(s) for s in shape]
        if not allowzero:                       # 0 keeps the input's dimension
            shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        try:
            return (x.reshape(shape),)
        except ValueError as err:
            raise ValueError(f"node {node.name!r} (Reshape): cannot reshape {x.shape} to "
                             f"{tuple(shape)}") from err
    return reshape


@operator("Transpose", ("perm",))
def _transpose(node, const):
    perm = node.attrs.get("perm")
    return lambda x: (np.transpose(x, perm),)


@operator("Pad", ("mode",))
def _pad(node, const):
    mode = node.attrs.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise unsupported(node, f"mode {mode!r}; supported: constant, reflect, edge")

    def pad(x, pads, value=None, axes=None):
        rank = x.ndim
        axes = range(rank) if axes is None else _axes(axes, rank)
        pads = [int(p) for p in pads]
        before, after = [0] * rank, [0] * rank
        for i, a in enumerate(axes):
            before[a], after[a] = pads[i], pads[i + len(pads) // 2]
        # Negative pads crop: cut first, then pad what is positive.
        x = x[tuple(slice(max(-b, 0), x.shape[i] - max(-e, 0))
                    for i, (b, e) in enumerate(zip(before, after)))]
        width = [(max(b, 0), max(e, 0)) for b, e in zip(before, after)]
        if mode == "constant":
            fill = 0 if value is None or np.size(value) == 0 else np.ravel(value)[0]
            return (np.pad(x, width, mode="constant", constant_values=fill),)
        return (np.pad(x, width, mode=mode),)
    return pad
