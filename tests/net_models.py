"""Small ONNX models built with ``onnx.helper`` for the network tests: the blocks
ResNet, MobileNetV2, SqueezeNet and VGG-style models are made of, every pooling form
and every fused pattern, with random weights from a seeded generator."""
import numpy as np

from tilegemm.tools.zoo import Builder


def random_input(shape, seed=0):
    """A float32 input of ``shape``, normal values from ``seed``."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def assert_close(got, expected):
    """float32 arithmetic through a few layers: within 1e-4 of the output's scale."""
    scale = max(float(np.max(np.abs(expected))), 1e-3)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)


def resnet(seed=0):
    """Stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool), a basic block, a downsampling
    block with a 1x1/2 shortcut, and the head (global average, flatten, Gemm,
    softmax): the patterns of ResNet-18."""
    b = Builder(seed)
    y = b.conv_bn("x", 3, 8, 7, strides=[2, 2], pads=[3, 3, 3, 3])
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    skip = y
    y = b.conv_bn(y, 8, 8, 3, pads=[1, 1, 1, 1])
    y = b.conv_bn(y, 8, 8, 3, act=None, pads=[1, 1, 1, 1])
    y = b.op("Relu", [b.op("Add", [y, skip])])
    skip = b.conv_bn(y, 8, 16, 1, act=None, strides=[2, 2])
    y = b.conv_bn(y, 8, 16, 3, strides=[2, 2], pads=[1, 1, 1, 1])
    y = b.conv_bn(y, 16, 16, 3, act=None, pads=[1, 1, 1, 1])
    y = b.op("Relu", [b.op("Add", [skip, y])])
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])])
    y = b.op("Gemm", [y, b.random(10, 16), b.random(10, scale=0.1)], transB=1)
    return b.model(["N", 3, 32, 32], [(b.op("Softmax", [y], axis=1), 2)])


def mobilenet(seed=1):
    """An inverted residual block (1x1 expand + ReLU6, 3x3 depthwise + ReLU6, 1x1
    linear projection, residual Add), HardSwish, a stride-2 depthwise conv with
    SAME_UPPER padding (asymmetric), and a Reshape whose shape comes from a
    Shape/Gather/Unsqueeze/Concat subgraph."""
    b = Builder(seed)
    y = b.conv_bn("x", 4, 8, 3, act=None, pads=[1, 1, 1, 1])
    y = b.clip6(y)
    skip = y
    z = b.clip6(b.conv_bn(y, 8, 24, 1, act=None))
    z = b.clip6(b.conv_bn(z, 24, 24, 3, act=None, groups=24, pads=[1, 1, 1, 1]))
    z = b.conv_bn(z, 24, 8, 1, act=None)
    y = b.op("HardSwish", [b.op("Add", [z, skip])])
    y = b.op("Relu", [b.conv(y, 8, 8, 3, groups=8, strides=[2, 2], auto_pad="SAME_UPPER")])
    y = b.op("GlobalAveragePool", [y])
    n = b.op("Gather", [b.op("Shape", [y]), b.const(np.array(0, np.int64))], axis=0)
    shape = b.op("Concat", [b.op("Unsqueeze", [n, b.const(np.array([0], np.int64))]),
                            b.const(np.array([-1], np.int64))], axis=0)
    y = b.op("Reshape", [y, shape])
    y = b.op("MatMul", [y, b.random(8, 5)])
    return b.model(["N", 4, 15, 15], [(y, 2)])


def fire(seed=2):
    """A SqueezeNet fire module (1x1 squeeze, 1x1 and 3x3 expands concatenated), then
    every pooling form: ceil-mode average pooling with and without the pads counted,
    dilated max pooling, global max pooling; and LeakyRelu, Sigmoid, HardSigmoid,
    a broadcast Mul, a reflect Pad, Transpose, Dropout, Identity, Sub and Div."""
    b = Builder(seed)
    s = b.op("Relu", [b.conv("x", 6, 4, 1)])
    e1 = b.op("Relu", [b.conv(s, 4, 6, 1)])
    e3 = b.op("LeakyRelu", [b.conv(s, 4, 6, 3, pads=[1, 1, 1, 1])], alpha=0.1)
    y = b.op("Concat", [e1, e3], axis=1)
    a = b.op("AveragePool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
             ceil_mode=1, count_include_pad=1)
    c = b.op("AveragePool", [y], kernel_shape=[3, 2], strides=[2, 1], pads=[0, 1, 1, 0],
             ceil_mode=1)
    m = b.op("MaxPool", [y], kernel_shape=[2, 2], strides=[2, 2], dilations=[2, 2], ceil_mode=1)
    gate = b.op("Sigmoid", [b.op("GlobalMaxPool", [m])])
    y = b.op("Mul", [a, gate])
    y = b.op("Mul", [y, b.random(1, 12, 1, 1, scale=1.0)])
    y = b.op("HardSigmoid", [b.op("Sub", [y, b.const(np.float32(0.25))])], alpha=0.3, beta=0.4)
    y = b.op("Pad", [y, b.const(np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64))], mode="reflect")
    y = b.op("Identity", [b.op("Dropout", [y])])
    y = b.op("Transpose", [y], perm=[0, 2, 3, 1])
    z = b.op("Div", [c, b.const(np.float32(3))])
    return b.model(["N", 6, 9, 11], [(y, 4), (z, 4)])


def vgg(seed=3):
    """VGG-style: 3x3 conv + bias + ReLU pairs, max pooling, a residual sum of two
    convs (Conv + Conv + Sum + ReLU), a standalone BatchNormalization, and a Gemm +
    ReLU classifier."""
    b = Builder(seed)
    y = b.op("Relu", [b.conv("x", 3, 8, 3, pads=[1, 1, 1, 1])])
    y = b.op("MaxPool", [y], kernel_shape=[2, 2], strides=[2, 2])
    p = b.conv(y, 8, 8, 3, pads=[1, 1, 1, 1])
    q = b.conv(y, 8, 8, 1, dilations=[1, 1])
    y = b.op("Relu", [b.op("Add", [p, q])])
    y = b.bn(b.op("Add", [y, b.conv(y, 8, 8, 3, pads=[2, 2, 2, 2], dilations=[2, 2])]), 8)
    y = b.op("Flatten", [b.op("MaxPool", [y], kernel_shape=[2, 2], strides=[2, 2])])
    y = b.op("Relu", [b.op("Gemm", [y, b.random(8 * 4 * 4, 12), b.random(12, scale=0.1)])])
    y = b.op("Gemm", [y, b.random(7, 12), b.random(1, 7, scale=0.1)], transB=1, alpha=0.5,
             beta=2.0)
    return b.model(["N", 3, 16, 16], [(y, 2)])


#: name -> (builder, input shape for a batch of 2)
MODELS = {"resnet": (resnet, (2, 3, 32, 32)), "mobilenet": (mobilenet, (2, 4, 15, 15)),
          "fire": (fire, (2, 6, 9, 11)), "vgg": (vgg, (2, 3, 16, 16))}
