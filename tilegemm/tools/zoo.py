"""Standard CNNs as ONNX models built with ``onnx.helper`` and random weights (no
download): ResNet-18, MobileNetV2 and VGG-11, for the network benchmark and
``python -m tilegemm run --model``.

The architectures are torchvision's (layer for layer: kernel sizes, strides, pads,
channel counts, BatchNorm after every conv, the classifier); the weights are drawn
with He scaling so that activations keep their scale through the depth.
"""
import numpy as np

#: name -> (builder, input shape of one image)
MODELS = {}


def model(name, shape):
    def register(build):
        MODELS[name] = (build, shape)
        return build
    return register


class Builder:
    """Appends ONNX nodes and constants; :meth:`model` wraps them into a ModelProto."""

    def __init__(self, seed=0, dtype=np.float32):
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.nodes, self.inits = [], []

    def const(self, array, name=None):
        from onnx import numpy_helper
        name = name or f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def random(self, *shape, scale=None):
        """A constant of normal values; ``scale`` defaults to He's sqrt(2 / fan_in)."""
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        scale = np.sqrt(2 / fan_in) if scale is None else scale
        return self.const((self.rng.standard_normal(shape) * scale).astype(self.dtype))

    def op(self, op, inputs, outputs=1, **attrs):
        from onnx import helper
        names = [f"{op.lower()}{len(self.nodes)}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), names,
                                           name=f"{op}_{len(self.nodes)}", **attrs))
        return names[0] if outputs == 1 else names

    def conv(self, x, cin, cout, k, bias=True, groups=1, **attrs):
        w = self.random(cout, cin // groups, k, k)
        inputs = [x, w] + ([self.random(cout, scale=0.1)] if bias else [])
        return self.op("Conv", inputs, group=groups, **attrs)

    def bn(self, x, c):
        """Inference BatchNormalization with parameters near the identity."""
        gamma = self.const((1 + 0.1 * self.rng.standard_normal(c)).astype(self.dtype))
        beta = self.const((0.1 * self.rng.standard_normal(c)).astype(self.dtype))
        mean = self.const((0.1 * self.rng.standard_normal(c)).astype(self.dtype))
        var = self.const(self.rng.uniform(0.5, 1.5, c).astype(self.dtype))
        return self.op("BatchNormalization", [x, gamma, beta, mean, var], epsilon=1e-5)

    def conv_bn(self, x, cin, cout, k, act="Relu", **attrs):
        """Conv (no bias) -> BatchNormalization -> ``act`` (None: no activation)."""
        y = self.bn(self.conv(x, cin, cout, k, bias=False, **attrs), cout)
        if act == "Relu6":
            return self.clip6(y)
        return self.op(act, [y]) if act else y

    def clip6(self, x):
        return self.op("Clip", [x, self.const(np.float32(0)), self.const(np.float32(6))])

    def model(self, x_shape, outputs, opset=17, x_name="x"):
        """The ModelProto of input ``x_shape`` and ``outputs``, each ``(name, rank)``."""
        from onnx import TensorProto, helper
        elem = TensorProto.FLOAT if self.dtype == np.float32 else TensorProto.DOUBLE
        outs = [helper.make_tensor_value_info(o, elem, [f"{o}_{i}" for i in range(rank)])
                for o, rank in outputs]
        graph = helper.make_graph(
            self.nodes, "tilegemm-zoo", [helper.make_tensor_value_info(x_name, elem, x_shape)],
            outs, self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _head(b, y, channels, classes=1000):
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])])
    y = b.op("Gemm", [y, b.random(classes, channels, scale=0.01), b.random(classes, scale=0.01)],
             transB=1)
    return b.model(["N", 3, 224, 224], [(y, 2)])


def _basic_block(b, x, cin, cout, stride):
    """ResNet's basic block: two 3x3 convs, the identity (or a 1x1/stride conv) added."""
    y = b.conv_bn(x, cin, cout, 3, strides=[stride] * 2, pads=[1] * 4)
    y = b.conv_bn(y, cout, cout, 3, act=None, pads=[1] * 4)
    skip = x if stride == 1 and cin == cout else b.conv_bn(x, cin, cout, 1, act=None,
                                                           strides=[stride] * 2)
    return b.op("Relu", [b.op("Add", [y, skip])])


@model("resnet18", (3, 224, 224))
def resnet18(seed=0):
    b = Builder(seed)
    y = b.conv_bn("x", 3, 64, 7, strides=[2, 2], pads=[3] * 4)
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        y = _basic_block(b, y, cin, cout, stride)
        y = _basic_block(b, y, cout, cout, 1)
        cin = cout
    return _head(b, y, 512)


#: MobileNetV2's inverted residual stages: (expansion t, channels c, blocks n, stride s).
MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))


def _inverted_residual(b, x, cin, cout, t, stride):
    hidden = cin * t
    y = b.conv_bn(x, cin, hidden, 1, act="Relu6") if t != 1 else x
    y = b.conv_bn(y, hidden, hidden, 3, act="Relu6", groups=hidden, strides=[stride] * 2,
                  pads=[1] * 4)
    y = b.conv_bn(y, hidden, cout, 1, act=None)
    return b.op("Add", [x, y]) if stride == 1 and cin == cout else y


@model("mobilenet_v2", (3, 224, 224))
def mobilenet_v2(seed=0):
    b = Builder(seed)
    y = b.conv_bn("x", 3, 32, 3, act="Relu6", strides=[2, 2], pads=[1] * 4)
    cin = 32
    for t, c, n, s in MOBILENET_V2:
        for i in range(n):
            y = _inverted_residual(b, y, cin, c, t, s if i == 0 else 1)
            cin = c
    y = b.conv_bn(y, cin, 1280, 1, act="Relu6")
    return _head(b, y, 1280)


#: VGG-11's convolutions (channels) and max pools ("M").
VGG_11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


@model("vgg11", (3, 224, 224))
def vgg11(seed=0):
    b = Builder(seed)
    y, cin = "x", 3
    for v in VGG_11:
        if v == "M":
            y = b.op("MaxPool", [y], kernel_shape=[2, 2], strides=[2, 2])
        else:
            y, cin = b.op("Relu", [b.conv(y, cin, v, 3, pads=[1] * 4)]), v
    y = b.op("Flatten", [y])
    for fan_in, fan_out in ((512 * 7 * 7, 4096), (4096, 4096)):
        y = b.op("Gemm", [y, b.random(fan_out, fan_in), b.random(fan_out, scale=0.01)], transB=1)
        y = b.op("Dropout", [b.op("Relu", [y])])
    y = b.op("Gemm", [y, b.random(1000, 4096, scale=0.01), b.random(1000, scale=0.01)], transB=1)
    return b.model(["N", 3, 224, 224], [(y, 2)])
