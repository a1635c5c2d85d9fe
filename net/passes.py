"""Graph passes, each a function ``pass(graph) -> graph`` that rewrites in place.

:func:`optimize` runs them in order: constant folding, dead-node removal,
BatchNorm folded into the conv before it, the residual Add fused into a conv's
epilogue, then the activation (relu, relu6) fused into a conv's or Gemm's.  A conv
summing a residual applies the activation after the sum, so the residual is fused
first: Conv -> BatchNormalization -> Add -> Relu becomes one conv.
"""
import numpy as np

from tilegemm.conv import fold_batchnorm as fold_weights
from tilegemm.net import registry


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


#: The passes :func:`optimize` runs, in order.
PASSES = (fold_constants, remove_dead, fold_batchnorm, fuse_residual, fuse_activation)


def optimize(graph):
    """``graph`` after every pass of :data:`PASSES`."""
    for step in PASSES:
        graph = step(graph)
    return graph
