"""Graph passes, each a function ``pass(graph) -> graph`` that rewrites in place.

:func:`optimize` runs them in order: a quantized model's convolutions, residual sums
and max pooling onto the int8 codes (before constant folding would dequantize the
weights), dead-node removal, a quantized residual sum into the epilogue of the conv
whose codes it sums, constant folding, BatchNorm folded into the conv before it, the
residual Add fused into a conv's epilogue, then the activation (relu, relu6) fused
into a conv's or Gemm's.  A conv summing a residual applies the activation after the
sum, so the residual is fused first: Conv -> BatchNormalization -> Add -> Relu
becomes one conv.
"""
import numpy as np

from tilegemm.conv import fold_batchnorm as fold_weights
from tilegemm.net import registry
from tilegemm.net.graph import Node


def fold_constants(graph):
    """Run at load time every node whose inputs are all constants."""
    kept = []
    for node in graph.nodes:
        names = [n for n in node.inputs if n]
        if node.op in ("Dropout",) or not all(n in graph.constants for n in names):
            kept.append(node)
            continue
        fn = registry.build(node, graph.constants.get)
        values = fn(*[graph.constants[n] if n else None for n in node.inputs])
        for name, value in zip(node.outputs, values):
            if name:
                graph.constants[name] = np.asarray(value)
    graph.nodes = kept
    return graph


def remove_dead(graph):
    """Drop the nodes no output depends on, and the constants no node reads."""
    needed = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if any(n in needed for n in node.outputs if n):
            kept.append(node)
            needed.update(n for n in node.inputs if n)
    graph.nodes = kept[::-1]
    graph.constants = {k: v for k, v in graph.constants.items() if k in needed}
    return graph


def _single_reader(graph, readers, tensor, node):
    """Whether ``node`` is the only reader of ``tensor`` and it is no graph output."""
    return readers.get(tensor) == [node] and tensor not in graph.outputs


def fold_batchnorm(graph):
    """Conv -> BatchNormalization (inference, constant parameters) becomes one Conv
    with folded weights and bias, when nothing else reads the conv's output."""
    readers, producers = graph.consumers(), graph.producers()
    dropped = set()
    for bn in graph.nodes:
        if bn.op != "BatchNormalization" or bn.attrs.get("training_mode", 0):
            continue
        conv = producers.get(bn.inputs[0])
        params = [graph.constants.get(n) for n in bn.inputs[1:5]]
        if (conv is None or conv.op != "Conv" or conv.epilogue or any(p is None for p in params)
                or not _single_reader(graph, readers, conv.outputs[0], bn)
                or conv.inputs[1] not in graph.constants):
            continue
        bias = graph.constants.get(conv.inputs[2]) if len(conv.inputs) > 2 else None
        w, b = fold_weights(graph.constants[conv.inputs[1]], bias, *params,
                            eps=bn.attrs.get("epsilon", 1e-5))
        dtype = graph.constants[conv.inputs[1]].dtype
        names = (f"{conv.name}/folded_weight", f"{conv.name}/folded_bias")
        graph.constants[names[0]], graph.constants[names[1]] = w.astype(dtype), b.astype(dtype)
        conv.inputs[1:] = list(names)
        conv.outputs = [bn.outputs[0]]
        conv.fused.append("BatchNormalization")
        dropped.add(id(bn))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    return graph


def fuse_residual(graph):
    """Add(conv output, other) becomes the conv with ``other`` as its residual, when
    the conv has no epilogue yet and nothing else reads its output.  The conv moves
    to the Add's place, where ``other`` is known to be computed.  When both operands
    are convs the later one takes the sum (the earlier one's output is then ready)."""
    readers, producers = graph.consumers(), graph.producers()
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    for add in list(graph.nodes):
        if add.op != "Add" or add.inputs[0] == add.inputs[1]:
            continue
        candidates = [(order[id(producers[t])], t, other) for t, other in
                      (add.inputs, add.inputs[::-1])
                      if t in producers and producers[t].op == "Conv"
                      and not producers[t].epilogue and _single_reader(graph, readers, t, add)]
        if not candidates:
            continue
        _, tensor, other = max(candidates)
        conv = producers[tensor]
        while len(conv.inputs) < 3:
            conv.inputs.append("")
        conv.inputs.append(other)
        conv.outputs = list(add.outputs)
        conv.epilogue["residual"] = True
        conv.fused.append("Add")
        graph.nodes[graph.nodes.index(add)] = conv
        graph.nodes.remove(conv)              # the first occurrence: its old place
    return graph


def _activation_of(graph, node):
    """"relu" or "relu6" if ``node`` is one of those activations, else None."""
    if node.op == "Relu":
        return "relu"
    if node.op == "Clip":
        bounds = [graph.constants.get(n) if n else None for n in node.inputs[1:3]]
        bounds += [None] * (2 - len(bounds))
        lo, hi = (None if b is None else float(np.ravel(b)[0]) for b in bounds)
        if lo == 0 and hi is None and (len(node.inputs) < 3 or not node.inputs[2]):
            return "relu"
        if lo == 0 and hi == 6:
            return "relu6"
    return None


def fuse_activation(graph):
    """Conv or Gemm -> Relu / Clip(0, 6) becomes the conv (Gemm) with the activation
    in its epilogue, when nothing else reads its output."""
    readers, producers = graph.consumers(), graph.producers()
    dropped = set()
    for node in graph.nodes:
        act = _activation_of(graph, node)
        source = producers.get(node.inputs[0]) if act else None
        if (source is None or source.op not in ("Conv", "Gemm")
                or "activation" in source.epilogue
                or not _single_reader(graph, readers, node.inputs[0], node)):
            continue
        source.epilogue["activation"] = act
        source.outputs = list(node.outputs)
        source.fused.append(node.op)
        dropped.add(id(node))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    return graph


# --------------------------------------------------------------------------- QDQ models
def _codes_of(graph, producers, tensor, per_channel=False, axis=0):
    """The DequantizeLinear writing ``tensor``, when it dequantizes int8/uint8 codes
    with a constant scale and zero point (one each, or with ``per_channel`` one per
    index of ``axis`` and zero points 0), else None."""
    node = producers.get(tensor)
    if node is None or node.op != "DequantizeLinear":
        return None
    names = list(node.inputs) + [""]
    scale = graph.constants.get(names[1])
    zero = graph.constants.get(names[2]) if names[2] else None
    if scale is None or (names[2] and (zero is None or zero.dtype not in (np.int8, np.uint8))):
        return None
    if scale.size == 1 and (zero is None or zero.size == 1):
        return node
    return node if (per_channel and node.attrs.get("axis", 1) == axis and scale.ndim == 1
                    and (zero is None or not np.any(zero))) else None


def _symmetric_int8(graph, dq):
    """Whether DequantizeLinear ``dq`` reads constant int8 codes with no zero point
    other than 0 (what the int8 kernels take as weights)."""
    codes = graph.constants.get(dq.inputs[0])
    zero = graph.constants.get(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] else None
    return codes is not None and codes.dtype == np.int8 and (zero is None or not np.any(zero))


def _quantizer(graph, readers, tensor):
    """The QuantizeLinear that is the only reader of ``tensor``, when its scale and
    zero point are constant scalars, else None."""
    found = readers.get(tensor, [])
    q = found[0] if found else None
    if q is None or q.op != "QuantizeLinear" or not _single_reader(graph, readers, tensor, q):
        return None
    names = list(q.inputs) + [""]
    scale = graph.constants.get(names[1])
    zero = graph.constants.get(names[2]) if names[2] else None
    if scale is None or scale.size != 1 or (names[2] and (zero is None or zero.size != 1)):
        return None
    return q


def _qdq_bias(graph, producers, conv):
    """The name of ``conv``'s bias as a float constant ("" without one; a bias
    dequantized from int32 is dequantized here), or None when it is computed."""
    name = conv.inputs[2] if len(conv.inputs) > 2 else ""
    if not name or name in graph.constants:
        return name
    dq = producers.get(name)
    if dq is None or dq.op != "DequantizeLinear":
        return None
    names = list(dq.inputs) + [""]
    values = [graph.constants.get(n) if n else np.zeros(1, np.int32) for n in names[:3]]
    if any(v is None for v in values) or values[0].dtype != np.int32 or np.any(values[2]):
        return None
    graph.constants[f"{conv.name}/bias"] = values[0] * values[1].astype(np.float64)
    return f"{conv.name}/bias"


def _gemm_bias(graph, producers, gemm, w):
    """:func:`_qdq_bias` of a Gemm of the constant codes ``w`` that the int8 kernels
    can run (``transA = 0``, ``alpha = 1``, and a bias of one value per output column
    with ``beta = 1``), its bias as a 1-D constant; else None."""
    attrs = gemm.attrs
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
        return None
    name = _qdq_bias(graph, producers, gemm)
    if not name:
        return name
    bias = graph.constants[name]
    columns = w.shape[0 if attrs.get("transB", 0) else 1] if w.ndim == 2 else -1
    # (n,) or (1, n): a row added to every row ((n, 1) would broadcast down the rows)
    if attrs.get("beta", 1.0) != 1.0 or bias.shape not in ((columns,), (1, columns)):
        return None
    graph.constants[f"{gemm.name}/bias"] = bias.reshape(-1)
    return f"{gemm.name}/bias"


def fuse_qdq(graph):
    """Conv(DequantizeLinear(codes), DequantizeLinear(int8 weights), bias) becomes a
    QLinearConv on the codes (:mod:`tilegemm.net.quantized`), with a Relu or Clip(0, 6)
    after it in its epilogue and, when a QuantizeLinear is the only reader, its
    requantization too: the activations between convs then stay int8.  A Gemm of
    the same form becomes a QGemm (com.microsoft's operator: the classifier of a
    QDQ model on the int8 kernels).  The DequantizeLinear nodes stay for any other
    reader."""
    readers, producers = graph.consumers(), graph.producers()
    dropped = set()
    for i, node in enumerate(graph.nodes):
        if node.op not in ("Conv", "Gemm") or node.epilogue:
            continue
        x_dq = _codes_of(graph, producers, node.inputs[0])
        # per output channel: axis 0 of a Conv's weights, of B (n x k) with transB, of
        # B (k x n) without it: axis 1
        w_dq = _codes_of(graph, producers, node.inputs[1], per_channel=True,
                         axis=0 if node.op == "Conv" or node.attrs.get("transB", 0) else 1)
        if x_dq is None or w_dq is None or not _symmetric_int8(graph, w_dq):
            continue                  # left as written: it then runs in float
        bias = (_qdq_bias(graph, producers, node) if node.op == "Conv" else
                _gemm_bias(graph, producers, node, graph.constants[w_dq.inputs[0]]))
        if bias is None:
            continue
        chain, out = [], node.outputs[0]
        after = readers.get(out, [])
        if len(after) == 1 and _activation_of(graph, after[0]) and out not in graph.outputs:
            chain.append(after[0])
            out = after[0].outputs[0]
        q = _quantizer(graph, readers, out)
        chain += [q] if q is not None else []
        y = (list(q.inputs) + [""])[1:3] if q is not None else ["", ""]
        codes = [x_dq.inputs[0], *(list(x_dq.inputs) + [""])[1:3],
                 w_dq.inputs[0], w_dq.inputs[1], ""]
        op, inputs = (("QLinearConv", codes + y + [bias]) if node.op == "Conv"
                      else ("QGemm", codes + [bias] + y))
        attrs = {k: v for k, v in node.attrs.items() if k != "beta"}    # 1 (QGemm has none)
        fused = Node(op, node.name, inputs, [chain[-1].outputs[0] if chain else out],
                     attrs, fused=["DequantizeLinear", node.op] + [n.op for n in chain])
        if chain and chain[0].op != "QuantizeLinear":
            fused.epilogue["activation"] = _activation_of(graph, chain[0])
        graph.nodes[i] = fused
        dropped.update(id(n) for n in chain)
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    return graph


def fuse_qdq_add(graph):
    """Add(DequantizeLinear(a), DequantizeLinear(b)) -> [Relu] -> QuantizeLinear, every
    scale and zero point a constant scalar, becomes one QLinearAdd on the codes
    (a QDQ model's residual sums: one pass instead of four)."""
    readers, producers = graph.consumers(), graph.producers()
    dropped = set()
    for i, add in enumerate(graph.nodes):
        if add.op != "Add":
            continue
        dqs = [_codes_of(graph, producers, t) for t in add.inputs]
        if any(dq is None for dq in dqs):
            continue
        chain, out = [], add.outputs[0]
        after = readers.get(out, [])
        if len(after) == 1 and _activation_of(graph, after[0]) == "relu" \
                and out not in graph.outputs:
            chain.append(after[0])
            out = after[0].outputs[0]
        q = _quantizer(graph, readers, out)
        if q is None:
            continue
        inputs = [name for dq in dqs for name in (list(dq.inputs) + [""])[:3]]
        fused = Node("QLinearAdd", add.name, inputs[:3] + inputs[3:6]
                     + (list(q.inputs) + [""])[1:3], list(q.outputs), fused=["DequantizeLinear",
                     "Add"] + [n.op for n in chain] + ["QuantizeLinear"])
        if chain:
            fused.epilogue["activation"] = "relu"
        graph.nodes[i] = fused
        dropped.update(id(n) for n in chain + [q])
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    return graph


def fuse_qconv_sum(graph):
    """A QLinearAdd of a QLinearConv's codes, which nothing else reads, becomes that
    conv with the sum in its epilogue (``epilogue["sum"]``; inputs: the conv's nine,
    then the residual, its scale and zero point, the sum's): the conv's codes are
    summed while in cache (:class:`tilegemm.conv.qconv.QuantizedSum`), bit for bit as
    the QLinearAdd.  The conv moves to the Add's place, where the residual is known to be
    computed; when both operands are such convs the later one takes the sum."""
    readers, producers = graph.consumers(), graph.producers()
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    for add in list(graph.nodes):
        if add.op != "QLinearAdd" or add.inputs[0] == add.inputs[3]:
            continue
        candidates = [(order[id(producers[add.inputs[i]])], i) for i in (0, 3)
                      if _sums_codes(graph, readers, producers, add, i)]
        if not candidates:
            continue
        i = max(candidates)[1]
        conv = producers[add.inputs[i]]
        other = 3 - i
        conv.inputs = (list(conv.inputs) + [""] * 9)[:9] + add.inputs[other:other + 3] \
            + (list(add.inputs) + [""] * 8)[6:8]
        conv.outputs = list(add.outputs)
        conv.epilogue["sum"] = {"activation": add.epilogue.get("activation"),
                                "conv_first": i == 0}
        conv.fused += add.fused
        graph.nodes[graph.nodes.index(add)] = conv
        graph.nodes.remove(conv)              # the first occurrence: its old place
    return graph


def _sums_codes(graph, readers, producers, add, i):
    """Whether a QLinearAdd's operand ``i`` (0 or 3) is the codes of a QLinearConv that
    can take the sum: read by the Add alone, dequantized by the scale and zero point
    the conv quantized them with, no sum fused yet."""
    conv = producers.get(add.inputs[i])
    if conv is None or conv.op != "QLinearConv" or "sum" in conv.epilogue \
            or not _single_reader(graph, readers, add.inputs[i], add):
        return False
    mine = (list(conv.inputs) + [""] * 8)[6:8]
    theirs = (list(add.inputs) + [""] * 8)[i + 1:i + 3]
    return bool(mine[0]) and all(a == b or a and b and _same_constants(graph, a, b)
                                 for a, b in zip(mine, theirs))


def _same_constants(graph, a, b):
    """Whether tensor names ``a`` and ``b`` hold equal constants of one dtype."""
    x, y = graph.constants.get(a), graph.constants.get(b)
    return x is not None and y is not None and x.dtype == y.dtype and np.array_equal(x, y)


#: Operators that move values without changing them: between a DequantizeLinear and a
#: QuantizeLinear of the same scale and zero point they give the codes they read.
REARRANGE = ("Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity")


def _pools_codes(pool):
    """Whether a MaxPool takes every window's maximum from input values (no
    dilation, pads smaller than the kernel, no indices output)."""
    if len(pool.outputs) > 1 and pool.outputs[1]:
        return False
    kernel = pool.attrs.get("kernel_shape", ())
    pads = pool.attrs.get("pads", (0,) * 4)
    return (all(d == 1 for d in pool.attrs.get("dilations", (1, 1))) and len(pads) == 4
            and all(p < kernel[i % 2] for i, p in enumerate(pads)))


def fuse_qdq_codes(graph):
    """DequantizeLinear -> op -> QuantizeLinear with the same scale and zero point
    becomes the op on the codes, for the ops that move values (:data:`REARRANGE`) and
    MaxPool where every window holds an input value: dequantizing is monotonic and the
    quantizer gives each dequantized code back, so the maximum's code is the codes'
    maximum."""
    readers, producers = graph.consumers(), graph.producers()
    dropped = set()
    for node in graph.nodes:
        if not (node.op in REARRANGE or node.op == "MaxPool" and _pools_codes(node)):
            continue
        dq = _codes_of(graph, producers, node.inputs[0])
        q = None if dq is None else _quantizer(graph, readers, node.outputs[0])
        # Zero points given on both sides: without one, QuantizeLinear writes uint8
        # whatever the codes DequantizeLinear read.
        if q is None or len(dq.inputs) < 3 or len(q.inputs) < 3 or not all(
                a and _same_constants(graph, a, b) for a, b in zip(dq.inputs[1:3], q.inputs[1:3])):
            continue
        node.inputs[0], node.outputs = dq.inputs[0], list(q.outputs)
        node.fused += ["DequantizeLinear", "QuantizeLinear"]
        dropped.add(id(q))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    return graph


def fuse_qdq_global_pool(graph):
    """DequantizeLinear -> GlobalAveragePool -> QuantizeLinear, scales and zero points
    constant scalars, becomes one QLinearGlobalAveragePool on the codes
    (com.microsoft's operator: a QDQ classifier's pooling in one pass)."""
    readers, producers = graph.consumers(), graph.producers()
    dropped = set()
    for i, pool in enumerate(graph.nodes):
        if pool.op != "GlobalAveragePool":
            continue
        dq = _codes_of(graph, producers, pool.inputs[0])
        q = None if dq is None else _quantizer(graph, readers, pool.outputs[0])
        # a zero point says the codes are int8 or uint8 (without one they may be int32)
        if q is None or len(dq.inputs) < 3 or not dq.inputs[2]:
            continue
        graph.nodes[i] = Node("QLinearGlobalAveragePool", pool.name,
                              (list(dq.inputs) + [""])[:3] + (list(q.inputs) + [""])[1:3],
                              list(q.outputs), fused=["DequantizeLinear", "GlobalAveragePool",
                                                      "QuantizeLinear"])
        dropped.add(id(q))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    return graph


#: The passes :func:`optimize` runs, in order.
PASSES = (fuse_qdq, fuse_qdq_add, fuse_qdq_codes, fuse_qdq_global_pool, remove_dead,
          fuse_qconv_sum, fold_constants, remove_dead, fold_batchnorm, fuse_residual,
          fuse_activation)


def optimize(graph):
    """``graph`` after every pass of :data:`PASSES`."""
    for step in PASSES:
        graph = step(graph)
    return graph
