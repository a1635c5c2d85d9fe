"""The code's shape: module and function sizes, component layering, no private names across folders.

These are the structure rules of docs/architecture.md, checked on the source tree so
that they hold as the code grows.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Component folders, lowest first: each may import only the ones before it.
COMPONENTS = ("ground", "tuning", "packing", "kernels", "conv", "net", "tilegemm")
PACKAGE = {"ground": "tilegemm.ground", "tuning": "tilegemm.tuning",
           "packing": "tilegemm.packing", "kernels": "tilegemm.kernels",
           "conv": "tilegemm.conv", "net": "tilegemm.net", "tilegemm": "tilegemm"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
#: Plans cross the Python -> JIT boundary as objects (records, tuples), so no function
#: needs more.  An intrinsic's typing function counts its ``typingctx`` too.  The
#: micro-kernel flavours' typing function takes ``*args`` (one parameter here): their
#: flat argument list is the tile's ABI, ``ARGUMENTS`` in kernels/microkernel.py
#: (docs/kernels.md says why it stays flat).
MAX_PARAMETERS = 12
#: Public functions whose parameters are an outside operator's contract (with the most
#: they may take): ``qconv2d`` takes ONNX QLinearConv's inputs with conv2d's geometry,
#: ``conv2d`` torch's arguments with the fused epilogue's (``residual``, ``out``), and
#: ``PreparedConv`` (``__init__``) conv2d's with the input's shape and dtype.
WIDE_SIGNATURES = {("conv/qconv.py", "qconv2d"): 14, ("conv/api.py", "conv2d"): 14,
                   ("conv/api.py", "__init__"): 13}


def _modules():
    for folder in COMPONENTS:
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    yield folder, os.path.relpath(path, ROOT), path


MODULES = list(_modules())


def _component(module_name):
    """The component folder a ``tilegemm...`` module name lives in."""
    parts = module_name.split(".")
    for folder, package in PACKAGE.items():
        if folder != "tilegemm" and parts[:2] == package.split("."):
            return folder
    return "tilegemm"


def _tree(path):
    with open(path) as f:
        return ast.parse(f.read(), path)


def test_the_tree_is_found():
    assert len(MODULES) > 20 and {m[0] for m in MODULES} == set(COMPONENTS)


@pytest.mark.parametrize("folder, rel, path", MODULES, ids=[m[1] for m in MODULES])
def test_module_and_function_sizes(folder, rel, path):
    with open(path) as f:
        lines = f.read().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{rel} has {lines} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(_tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{rel}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("folder, rel, path", MODULES, ids=[m[1] for m in MODULES])
def test_no_function_takes_more_than_a_dozen_parameters(folder, rel, path):
    def count(args):
        return (len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
                + (args.vararg is not None) + (args.kwarg is not None))

    many = [f"{getattr(node, 'name', 'lambda')} ({count(node.args)})"
            for node in ast.walk(_tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            and count(node.args) > WIDE_SIGNATURES.get((rel, getattr(node, "name", "")),
                                                       MAX_PARAMETERS)]
    assert not many, f"{rel}: functions of over {MAX_PARAMETERS} parameters: {many}"


def _imports(tree):
    """(module, names, module_level) of every ``tilegemm`` import in a tree."""
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tilegemm"):
            yield node.module, [a.name for a in node.names], id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tilegemm"):
                    yield alias.name, [], id(node) in top


@pytest.mark.parametrize("folder, rel, path", MODULES, ids=[m[1] for m in MODULES])
def test_imports_respect_the_layers(folder, rel, path):
    """A component imports lower components' public names only."""
    rank = COMPONENTS.index(folder)
    for module, names, _ in _imports(_tree(path)):
        other = _component(module)
        if other == folder:
            continue
        assert COMPONENTS.index(other) < rank, f"{rel} imports {module} (a higher layer)"
        private = [n for n in names if n.startswith("_")]
        private += [p for p in module.split(".")[2:] if p.startswith("_")]
        assert not private, f"{rel} imports private {private} from {module}"


@pytest.mark.parametrize("folder, rel, path", MODULES, ids=[m[1] for m in MODULES])
def test_no_private_attribute_of_another_component(folder, rel, path):
    """``from tilegemm.kernels import driver`` then ``driver._plan``: a private name too."""
    tree = _tree(path)
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tilegemm"):
            if _component(node.module) != folder:
                bound.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tilegemm") and _component(a.name) != folder and a.asname:
                    bound.add(a.asname)
    private = sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in bound and node.attr.startswith("_")
                      and not node.attr.startswith("__")})
    assert not private, f"{rel} uses private names of another component: {private}"


def test_no_import_cycle_between_modules():
    """Deferred imports inside functions count too: a cycle is a cycle."""
    names = {}
    for folder, rel, path in MODULES:
        sub = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
        name = PACKAGE[folder] + ("" if sub == "__init__" else "." + sub.replace(".__init__", ""))
        names[name] = path
    graph = {}
    for name, path in names.items():
        edges = set()
        for module, imported, _ in _imports(_tree(path)):
            submodules = [f"{module}.{n}" for n in imported if f"{module}.{n}" in names]
            # ``from package import submodule`` needs the submodule, not the package's body.
            for target in submodules or [module]:
                if target in names and target != name:
                    edges.add(target)
        graph[name] = edges
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# --- the test files -------------------------------------------------------------------

TEST_FILES = sorted(os.path.join(folder, name)
                    for folder in ("tests", "bench")
                    for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith(".py"))


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _private_uses(tree):
    """``module._x``, ``from tilegemm... import _x``, ``setattr(module, "_x", ...)`` (any
    ``*.setattr``, e.g. monkeypatch's, or ``getattr``) and ``(module, "_x")`` tables, on
    names imported from tilegemm."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tilegemm"):
            bound.update(a.asname or a.name for a in node.names)
            yield from (f"from {node.module} import {a.name}" for a in node.names if _private(a.name))
            yield from (f"import {node.module}" for p in node.module.split(".") if _private(p))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tilegemm"):
                    bound.add(a.asname or a.name.split(".")[0])
                    yield from (f"import {a.name}" for p in a.name.split(".") if _private(p))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                yield ast.unparse(node)
        elif isinstance(node, ast.Tuple):
            # (module, "_x", ...) tables of what to patch: a name next to its module.
            for first, second in zip(node.elts, node.elts[1:]):
                if (isinstance(first, ast.Name) and first.id in bound
                        and isinstance(second, ast.Constant) and isinstance(second.value, str)
                        and _private(second.value)):
                    yield f"({first.id}, {second.value!r})"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in ("setattr", "getattr", "delattr", "hasattr"):
                continue
            strings = [a.value for a in node.args[:2]
                       if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            target = node.args[0]
            if isinstance(target, ast.Name) and target.id in bound and strings \
                    and _private(strings[0]):
                yield f"{name}({target.id}, {strings[0]!r})"
            # monkeypatch.setattr("tilegemm.kernels.driver._x", value)
            elif strings and strings[0].startswith("tilegemm.") and any(
                    _private(p) for p in strings[0].split(".")):
                yield f"{name}({strings[0]!r})"


@pytest.mark.parametrize("rel", TEST_FILES)
def test_test_file_sizes(rel):
    """Test files are split by what they test, like the modules they test."""
    with open(os.path.join(ROOT, rel)) as f:
        lines = f.read().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{rel} has {lines} lines"


@pytest.mark.parametrize("rel", TEST_FILES)
def test_tests_use_public_names_only(rel):
    """Tests reach the library as its users do: a private name a test needs is a seam
    that wants a public form (a decision function, a parameter), not a patch."""
    uses = sorted(set(_private_uses(_tree(os.path.join(ROOT, rel)))))
    assert not uses, f"{rel} uses private names of tilegemm: {uses}"
