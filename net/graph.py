"""A network as a graph: nodes in topological order, constant tensors, inputs and
outputs, and :func:`from_onnx`, which reads one from an ONNX model.

The graph is plain Python data that the passes (:mod:`tilegemm.net.passes`) rewrite
and :class:`tilegemm.net.Network` runs.  Parsing goes through the ``onnx`` package
(an optional extra); nothing here decodes protobuf by hand.
"""
import os
from dataclasses import dataclass, field

import numpy as np

#: The default ONNX operator set the operators are written against; older models
#: are converted to it with onnx's version converter.
MIN_OPSET = 13


@dataclass
class Node:
    """One operator: its ONNX type and name, tensor names in and out ("" for an
    omitted optional input), ONNX attributes as Python values, what the passes fused
    into it (``epilogue``: ``activation``, ``residual``) and the
    operator types they folded in (``fused``, for the profile)."""

    op: str
    name: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)
    epilogue: dict = field(default_factory=dict)
    fused: list = field(default_factory=list)


@dataclass(frozen=True)
class TensorInfo:
    """A graph input: name, shape (an int per fixed dimension, a name or None per
    symbolic one) and dtype."""

    name: str
    shape: tuple
    dtype: np.dtype


@dataclass
class Graph:
    """Nodes in topological order, constants by name, inputs and output names."""

    nodes: list
    constants: dict
    inputs: list
    outputs: list

    def consumers(self):
        """``{tensor name: [node, ...]}`` for every tensor some node reads."""
        readers = {}
        for node in self.nodes:
            for name in node.inputs:
                if name:
                    readers.setdefault(name, []).append(node)
        return readers

    def producers(self):
        """``{tensor name: node}`` for every tensor a node writes."""
        return {name: node for node in self.nodes for name in node.outputs if name}

    def check_order(self):
        """ValueError unless every node reads only tensors defined before it."""
        defined = set(self.constants) | {t.name for t in self.inputs}
        for node in self.nodes:
            for name in node.inputs:
                if name and name not in defined:
                    raise ValueError(f"node {node.name!r} ({node.op}) reads {name!r}, which no "
                                     "input, constant or earlier node defines")
            defined.update(n for n in node.outputs if n)
        missing = [name for name in self.outputs if name not in defined]
        if missing:
            raise ValueError(f"graph outputs {missing} are never computed")


def _onnx():
    """The ``onnx`` package, or an ImportError that says how to install it."""
    try:
        import onnx
    except ImportError as err:
        raise ImportError("load_onnx needs the onnx package: pip install 'tilegemm[onnx]' "
                          "(or pip install onnx)") from err
    return onnx


def read_model(model):
    """``(onnx.ModelProto, its bytes or None)`` from a path, bytes or a ModelProto
    (decoded, not yet checked; the bytes spare the checker serializing it again).

    Raises
    ------
    TypeError
        ``model`` is none of those.
    FileNotFoundError
        No such file.
    ValueError
        A file or bytes that are not an ONNX model (truncated, corrupt).
    """
    onnx = _onnx()
    data = None
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"load_onnx: no such model file: {os.fspath(model)!r}")
        with open(model, "rb") as f:
            model = f.read()
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
        try:
            model = onnx.load_model_from_string(data)
        except Exception as err:           # protobuf's DecodeError and friends
            raise ValueError(f"load_onnx: not a readable ONNX model ({err})") from err
    if not isinstance(model, onnx.ModelProto):
        raise TypeError("load_onnx: model must be a path, bytes or an onnx.ModelProto, "
                        f"got {type(model).__name__}")
    return model, data


def validated(read, supported):
    """The model of ``read`` (:func:`read_model`'s pair) checked by onnx's checker and
    converted to at least :data:`MIN_OPSET`.

    ``supported(op_type, node name)`` is asked first about every node, so an operator
    tilegemm does not run is reported as such rather than as an invalid model.
    """
    onnx = _onnx()
    model, data = read
    for i, n in enumerate(model.graph.node):
        name = n.name or f"{n.op_type}_{i}"
        if n.domain not in ("", "ai.onnx"):
            raise NotImplementedError(f"node {name!r}: operator {n.domain}.{n.op_type} is outside "
                                      "the default ONNX domain; only standard operators run")
        supported(n.op_type, name)
    try:
        onnx.checker.check_model(_skeleton(onnx, model))
    except onnx.checker.ValidationError as err:
        raise ValueError(f"load_onnx: the model is not valid ONNX: {err}") from err
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        model = onnx.version_converter.convert_version(model, MIN_OPSET)
    return model


def _skeleton(onnx, model):
    """``model`` with every initializer's values left out (name and type kept, no
    elements), for the checker: what it checks is the graph, and serialising a large
    model's weights for it cost seconds (VGG-11, 530 MB: 2.1 s against 0.03 s).  The
    values themselves are checked as they are read (:func:`from_onnx`)."""
    def copy(src, dst, skip=()):
        for field, value in src.ListFields():
            if field.name in skip:
                continue
            if hasattr(value, "extend"):                  # a repeated field
                getattr(dst, field.name).extend(value)
            elif hasattr(value, "CopyFrom"):              # a message
                getattr(dst, field.name).CopyFrom(value)
            else:
                setattr(dst, field.name, value)
    skeleton = onnx.ModelProto()
    copy(model, skeleton, skip=("graph",))
    copy(model.graph, skeleton.graph, skip=("initializer",))
    skeleton.graph.initializer.extend(onnx.helper.make_tensor(t.name, t.data_type, [0], [])
                                      for t in model.graph.initializer)
    return skeleton


def _initializer(onnx, tensor):
    """An initializer's values, or a ValueError naming it when they do not fit its shape."""
    try:
        return onnx.numpy_helper.to_array(tensor)
    except Exception as err:             # short or malformed data
        raise ValueError(f"load_onnx: initializer {tensor.name!r} is malformed ({err})") from err


def _attribute(onnx, attr):
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


def _constant_value(onnx, node):
    """The value of an ONNX ``Constant`` node."""
    attrs = {a.name: _attribute(onnx, a) for a in node.attribute}
    for key, dtype in (("value", None), ("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in attrs:
            return np.array(attrs[key], dtype=dtype)
    raise NotImplementedError(f"node {node.name!r} (Constant): only value, value_float(s) and "
                              f"value_int(s) are supported, got {sorted(attrs)}")


def _tensor_info(onnx, value_info):
    tensor = value_info.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                  for d in tensor.shape.dim)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    return TensorInfo(value_info.name, shape, dtype)


def from_onnx(model):
    """The :class:`Graph` of a checked ``onnx.ModelProto`` (:func:`validated`).

    Constant nodes become constants; every node keeps its ONNX attributes.
    """
    onnx = _onnx()
    proto = model.graph
    constants = {t.name: _initializer(onnx, t) for t in proto.initializer}
    nodes = []
    for i, n in enumerate(proto.node):
        name = n.name or f"{n.op_type}_{i}"
        if n.op_type == "Constant":
            constants[n.output[0]] = _constant_value(onnx, n)
            continue
        nodes.append(Node(n.op_type, name, list(n.input), list(n.output),
                          {a.name: _attribute(onnx, a) for a in n.attribute}))
    inputs = [_tensor_info(onnx, v) for v in proto.input if v.name not in constants]
    graph = Graph(nodes, constants, inputs, [v.name for v in proto.output])
    graph.check_order()
    return graph
