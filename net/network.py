"""A loaded network: its optimized graph as a list of steps, run with numpy arrays.

Each step is a node's run function (:mod:`tilegemm.net.registry`) with the names of
the tensors it reads and writes.  A tensor is dropped after its last reader, so a
run holds only the activations still needed; a conv summing a residual that no
later step reads writes its result into the residual's own buffer.
"""
import time
from dataclasses import dataclass

import numpy as np

from tilegemm.net import layers, ops, registry  # noqa: F401 (ops, layers: register builders)
from tilegemm.net.graph import from_onnx, read_model, validated
from tilegemm.net.passes import optimize

#: Operators whose result is a new array (never a view of an input), so an in-place
#: sum into it changes nothing else.
FRESH = frozenset({"Conv", "Add", "Sub", "Mul", "Div", "Relu", "Clip", "LeakyRelu", "Sigmoid",
                   "HardSigmoid", "HardSwish", "BatchNormalization", "MaxPool", "AveragePool",
                   "Concat", "Gemm", "MatMul"})


@dataclass
class Step:
    """One node ready to run: its function, the tensors it reads and writes, and the
    tensors no later step reads (dropped after it)."""

    node: object
    run: object
    inputs: list
    outputs: list
    frees: list


class Network:
    """A network loaded by :func:`tilegemm.load_onnx`; call it on arrays.

    Attributes
    ----------
    inputs : list of TensorInfo
        Name, shape (None or a name for a symbolic dimension) and dtype of each input.
    outputs : list of str
        Output names, in the model's order.
    graph : Graph
        The optimized graph (folded, fused) that runs.
    """

    def __init__(self, graph):
        self.graph = graph
        self.inputs = list(graph.inputs)
        self.outputs = list(graph.outputs)
        self._mark_in_place()
        self._steps = self._build()

    def _mark_in_place(self):
        """A fused conv may sum into its residual's buffer when the residual is a fresh
        array produced by a node, the conv is its last reader (the steps run in order,
        so the others are done with it) and it is not an output."""
        readers, producers = self.graph.consumers(), self.graph.producers()
        for node in self.graph.nodes:
            if node.op == "Conv" and node.epilogue.get("residual"):
                r = node.inputs[3]
                node.epilogue["in_place"] = (r in producers and producers[r].op in FRESH
                                             and readers[r][-1] is node
                                             and node.inputs.count(r) == 1
                                             and r not in self.outputs)

    def _build(self):
        constants = self.graph.constants
        last = {}
        for i, node in enumerate(self.graph.nodes):
            for name in node.inputs:
                last[name] = i
        steps = []
        for i, node in enumerate(self.graph.nodes):
            frees = [n for n in dict.fromkeys(node.inputs)
                     if n and last.get(n) == i and n not in constants and n not in self.outputs]
            steps.append(Step(node, registry.build(node, constants.get), list(node.inputs),
                              list(node.outputs), frees))
        return steps

    def _feeds(self, feeds):
        if not isinstance(feeds, dict):
            raise TypeError(f"Network.run: feeds must be a dict {{name: array}}, "
                            f"got {type(feeds).__name__}")
        names = {t.name for t in self.inputs}
        unknown = sorted(set(feeds) - names)
        if unknown:
            raise ValueError(f"Network.run: {unknown} are not inputs of this network "
                             f"(inputs: {sorted(names)})")
        values = {}
        for info in self.inputs:
            if info.name not in feeds:
                raise ValueError(f"Network.run: input {info.name!r} is missing")
            values[info.name] = _checked(info, feeds[info.name])
        return values

    def run(self, feeds, profile=None):
        """Outputs for ``feeds``.

        Parameters
        ----------
        feeds : dict
            ``{input name: array_like}`` for every input.  Float inputs may come in
            any float dtype; they are cast to the model's.
        profile : list, optional
            When given, one ``(node, seconds, input shapes)`` is appended per step run.

        Returns
        -------
        dict
            ``{output name: ndarray}``.

        Raises
        ------
        TypeError
            A non-dict ``feeds``, or an input of a non-float dtype where the model
            takes floats.
        ValueError
            A missing or unknown input, or one of the wrong rank or fixed dimensions.
        """
        values = dict(self.graph.constants)
        fed = self._feeds(feeds)
        values.update(fed)
        for step in self._steps:
            args = [values[n] if n else None for n in step.inputs]
            t0 = time.perf_counter() if profile is not None else 0.0
            results = step.run(*args)
            if profile is not None:
                profile.append((step.node, time.perf_counter() - t0,
                                [None if a is None else np.shape(a) for a in args]))
            for name, value in zip(step.outputs, results):
                if name:
                    values[name] = value
            for name in step.frees:
                del values[name]
        # An output that is a constant, or a view of an input, is copied: callers own it.
        return {name: np.array(values[name], copy=name in self.graph.constants or any(
                    np.may_share_memory(values[name], x) for x in fed.values()))
                for name in self.outputs}

    def describe(self, node, shapes):
        """``(algorithm, flops)`` of ``node`` run on inputs of ``shapes`` (a profile
        entry's): the conv path that runs it, or "" and 0 for an operator without one."""
        step = next(s for s in self._steps if s.node is node)
        describe = getattr(step.run, "describe", None)
        return describe(*shapes) if describe else ("", 0)

    def __call__(self, x):
        """The output for ``x`` (a tuple of outputs if the model has several), for a
        model with one input; ``run`` takes several."""
        if len(self.inputs) != 1:
            raise TypeError(f"Network: this model takes {len(self.inputs)} inputs "
                            f"{[t.name for t in self.inputs]}; call run({{name: array}})")
        results = self.run({self.inputs[0].name: x})
        out = tuple(results[name] for name in self.outputs)
        return out[0] if len(out) == 1 else out

    def __repr__(self):
        ins = ", ".join(f"{t.name}{list(t.shape)}" for t in self.inputs)
        return f"Network({len(self._steps)} steps, inputs: {ins}, outputs: {self.outputs})"


def _checked(info, value):
    """An input array: the model's dtype, its rank and fixed dimensions."""
    x = np.asarray(value)
    if info.dtype.kind == "f":
        if x.dtype.kind != "f":
            raise TypeError(f"Network.run: input {info.name!r} must be a float array "
                            f"({info.dtype}), got {x.dtype}")
        x = x.astype(info.dtype, copy=False)
    elif x.dtype != info.dtype:
        raise TypeError(f"Network.run: input {info.name!r} must be {info.dtype}, got {x.dtype}")
    if x.ndim != len(info.shape) or any(isinstance(d, int) and d > 0 and d != s
                                        for d, s in zip(info.shape, x.shape)):
        raise ValueError(f"Network.run: input {info.name!r} must have shape "
                         f"{tuple(d if isinstance(d, int) and d > 0 else '?' for d in info.shape)}"
                         f", got {x.shape}")
    return x


def load_onnx(model):
    """Load an ONNX model as a :class:`Network`.

    Parameters
    ----------
    model : str, os.PathLike, bytes or onnx.ModelProto
        The model (opset 13 or later; older ones are converted).

    Returns
    -------
    Network
        ``net(x)`` for a one-input model, ``net.run({name: array})`` in general.

    Raises
    ------
    ImportError
        Without the ``onnx`` package (``pip install 'tilegemm[onnx]'``).
    TypeError, FileNotFoundError, ValueError
        Not a model, no such file, or a file that is not valid ONNX.
    NotImplementedError
        An operator or attribute tilegemm does not run, naming the node.
    """
    graph = from_onnx(validated(read_model(model), registry.known))
    for node in graph.nodes:                  # unsupported operators fail before any pass
        registry.check(node)
    return Network(optimize(graph))
