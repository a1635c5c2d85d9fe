"""Small quantized ONNX models for the network tests, built with ``onnx.helper``: QDQ
form (QuantizeLinear / DequantizeLinear around float Conv and Add, as onnxruntime's
``quantize_static`` writes them) and QOperator nodes (QLinearConv, ConvInteger,
MatMulInteger, QLinearMatMul)."""
import numpy as np


class QBuilder:
    """Appends nodes and constants of a quantized model."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.count = [], [], 0

    def const(self, value):
        from onnx import numpy_helper
        self.count += 1
        name = f"k{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op, inputs, **attrs):
        from onnx import helper
        self.count += 1
        out = f"t{self.count}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"{op}_{self.count}",
                                           **attrs))
        return out

    def q(self, x, scale, zero):
        """QuantizeLinear with a scalar scale and a zero point of ``zero``'s dtype."""
        return self.node("QuantizeLinear", [x, self.const(np.float32(scale)), self.const(zero)])

    def dq(self, q, scale, zero, **attrs):
        return self.node("DequantizeLinear", [q, self.const(scale), self.const(zero)], **attrs)

    def qdq(self, x, scale, zero):
        """A float tensor through QuantizeLinear then DequantizeLinear."""
        return self.dq(self.q(x, scale, zero), np.float32(scale), zero)

    def weights(self, K, Cg, k, per_channel=True):
        """DequantizeLinear of int8 weights (symmetric), per output channel or not."""
        w = self.rng.integers(-127, 128, (K, Cg, k, k)).astype(np.int8)
        if per_channel:
            scale = self.rng.uniform(0.002, 0.02, K).astype(np.float32)
            return self.dq(self.const(w), scale, np.zeros(K, np.int8), axis=0)
        return self.dq(self.const(w), np.float32(0.01), np.int8(0))

    def conv(self, x, C, K, k, *, groups=1, bias="float", per_channel=True, **attrs):
        """A QDQ Conv on the dequantized ``x``: weights behind a DequantizeLinear, a
        float bias, one dequantized from int32, or none."""
        inputs = [x, self.weights(K, C // groups, k, per_channel)]
        if bias == "float":
            inputs.append(self.const(self.rng.normal(0, 0.3, K).astype(np.float32)))
        elif bias == "int32":
            scale = np.float32(self.rng.uniform(1e-4, 1e-3))
            b = self.rng.integers(-2000, 2000, K).astype(np.int32)
            inputs.append(self.dq(self.const(b), scale, np.int32(0)))
        return self.node("Conv", inputs, group=groups, kernel_shape=[k, k], **attrs)

    def model(self, x_shape, output, x_dtype=np.float32, out_dtype=np.float32, rank=4,
              opset=17):
        from onnx import helper
        elem, out_elem = (helper.np_dtype_to_tensor_dtype(np.dtype(t)) for t in (x_dtype, out_dtype))
        graph = helper.make_graph(
            self.nodes, "qdq", [helper.make_tensor_value_info("x", elem, x_shape)],
            [helper.make_tensor_value_info(output, out_elem, [f"d{i}" for i in range(rank)])],
            self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def residual_block(seed=0, C=8, H=9, relu_zero=np.uint8(0)):
    """x -> Q/DQ -> conv-relu -> Q/DQ -> conv -> Q/DQ -> Add(shortcut) -> Q/DQ: a ResNet
    basic block as quantize_static writes it (relus folded into zero points 0)."""
    b = QBuilder(seed)
    x = b.qdq("x", 0.05, np.uint8(128))
    y = b.qdq(b.node("Relu", [b.conv(x, C, C, 3, pads=[1, 1, 1, 1])]), 0.04, relu_zero)
    y = b.qdq(b.conv(y, C, C, 3, pads=[1, 1, 1, 1], bias="int32"), 0.06, np.uint8(120))
    out = b.qdq(b.node("Add", [y, x]), 0.07, np.uint8(100))
    return b.model([1, C, H, H], out)
