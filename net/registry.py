"""The operators a :class:`tilegemm.net.Network` runs, by ONNX type.

Each operator has a *builder*: ``build(node, const)`` checks the node's attributes
when the network is loaded (an unsupported one is a ``NotImplementedError`` naming
the node) and returns the function a run calls, ``fn(*inputs) -> tuple of
outputs``, with everything constant worked out once (``const(name)`` is the value of
a constant input, else None).  :mod:`tilegemm.net.ops` and
:mod:`tilegemm.net.layers` register them.
"""
BUILDERS = {}


def operator(name, attrs=()):
    """Register a builder for ONNX operator ``name`` taking the attributes ``attrs``."""
    def register(build):
        BUILDERS[name] = (build, frozenset(attrs))
        return build
    return register


def known(op, name):
    """NotImplementedError naming node ``name`` unless operator ``op`` has a builder."""
    if op != "Constant" and op not in BUILDERS:
        raise NotImplementedError(f"node {name!r}: operator {op} is not supported; "
                                  f"supported: {', '.join(sorted(BUILDERS))}")


def check(node):
    """NotImplementedError naming the node unless its operator and attributes are known."""
    known(node.op, node.name)
    allowed = BUILDERS[node.op][1]
    unknown = sorted(set(node.attrs) - allowed)
    if unknown:
        raise NotImplementedError(f"node {node.name!r} ({node.op}): attributes {unknown} are not "
                                  f"supported; supported: {sorted(allowed)}")


def build(node, const):
    """The run function of ``node`` (:func:`check` first)."""
    check(node)
    return BUILDERS[node.op][0](node, const)


def unsupported(node, what):
    """NotImplementedError for an attribute value or operand form of ``node``."""
    return NotImplementedError(f"node {node.name!r} ({node.op}): {what}")
