"""Micro-kernel tile functions compiled once, on their own, their object code cached.

A jitted loop that runs a tile calls it by name, through an external declaration
in its own LLVM module, instead of carrying the tile's body.  Numba links a
callee's module into every caller and optimises and code-generates it again
there, so a body held in the loop's module was compiled once per loop, and again
in each function calling that loop (docs/kernels.md, "Compile time on a cold
cache").  Here each tile is compiled once; its object code goes to
``<cache>/tiles/<sources digest>/``, named by the tile and the host CPU, and its
address is registered with LLVM's symbol table (``llvmlite.binding.add_symbol``)
before any code calling it is compiled or loaded from Numba's cache:

* :func:`load_cached`, when a template asks for its micro-kernels (module
  import), loads every tile already in the cache: a caller loaded from Numba's
  cache can only call a tile that some earlier process compiled, and stored,
  before that caller was compiled.
* :func:`define`, when a caller is compiled, compiles a tile not loaded yet.

A tile is compiled only when some loop that calls it is: a process that runs
only the packed GEMM never compiles the strided or convolution flavours.

The digest of the kernel sources and a per-folder ``EPOCH`` token go into every
generated module's header (:func:`header`): a new tilegemm version, or the tiles
folder deleted while generated modules stayed, rewrites the generated modules,
which makes Numba's cache of them stale, so no cached caller outlives its tiles.
"""
import functools
import hashlib
import os
import secrets

import llvmlite
import llvmlite.binding as llvm
import llvmlite.ir as ir

from tilegemm.ground import loader

_ready = {}  # symbol -> its object code
_compiled = set()  # the symbols this process compiled rather than loaded


@functools.lru_cache(maxsize=1)
def engine_digest():
    """Hash of every source the generated modules and tiles compile in.

    Numba's cache checks only the generated file itself; writing this digest into
    it makes any change to the kernel generators, templates, packing or ground
    contracts invalidate the cached machine code.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    return loader.digest(loader.python_files(here) + loader.python_files(os.path.join(root, "packing"))
                         + loader.python_files(os.path.join(root, "ground")))


def _folder():
    return os.path.join(loader.cache_dir(), "tiles", engine_digest())


def epoch():
    """The tiles folder's token, created with the folder (the first process wins)."""
    path = os.path.join(_folder(), "EPOCH")
    try:
        with open(path) as f:
            token = f.read().strip()
        if token:
            return token
    except OSError:
        pass
    loader.write_first(path, secrets.token_hex(8).encode())
    with open(path) as f:
        return f.read().strip()


def header():
    """The lines every generated module starts with (see the module docstring)."""
    return f"# engine sources digest: {engine_digest()}; tiles epoch: {epoch()}\n"


def _codegen():
    from numba.core.registry import cpu_target
    return cpu_target.target_context.codegen()


@functools.lru_cache(maxsize=1)
def _machine():
    """Numba's target (triple, CPU name and features: tiles and their callers agree)."""
    triple, cpu, features = _codegen().magic_tuple()
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_triple(triple).create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="default", codemodel="jitdefault")


@functools.lru_cache(maxsize=1)
def _engine():
    """The execution engine that holds every tile's machine code (process-wide)."""
    return llvm.create_mcjit_compiler(llvm.parse_assembly(""), _machine())


def _path(symbol):
    machine = repr((_codegen().magic_tuple(), llvmlite.__version__)).encode()
    return os.path.join(_folder(), f"{symbol}_{hashlib.sha256(machine).hexdigest()[:12]}.o")


def _lock():
    from numba.core.compiler_lock import global_compiler_lock
    return global_compiler_lock  # LLVM's state is shared with Numba's compiles: one lock


def load_cached(symbol):
    """Register ``symbol`` from the cache if it is there; whether it is now ready."""
    if symbol in _ready:
        return True
    with _lock():
        if symbol not in _ready:
            try:
                with open(_path(symbol), "rb") as f:
                    obj = f.read()
            except OSError:
                return False
            _register(symbol, obj)
    return True


def define(symbol, fnty, emit_body):
    """Make ``symbol``, a function of LLVM type ``fnty``, callable from jitted code.

    ``emit_body(builder, fn)`` writes its body.  Loaded from the cache if there,
    else compiled and stored; later calls return at once.
    """
    if load_cached(symbol):
        return
    with _lock():
        if symbol in _ready:
            return
        module = ir.Module(symbol)
        module.triple = _machine().triple
        module.data_layout = str(_machine().target_data)
        fn = ir.Function(module, fnty, symbol)
        emit_body(ir.IRBuilder(fn.append_basic_block("entry")), fn)
        obj = _compile(module)
        loader.write_atomic(_path(symbol), obj)
        _register(symbol, obj)
        _compiled.add(symbol)


def _compile(module):
    """Object code of ``module``: LLVM's O3 pipeline without its vectorisers and
    unroller.  The body is vector code already, its k loop unrolled as written;
    those passes would find nothing to do and cost half the compile."""
    machine = _machine()
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)
    tuning.loop_vectorization = tuning.slp_vectorization = tuning.loop_unrolling = False
    passes = llvm.create_pass_builder(machine, tuning)
    passes.getModulePassManager().run(parsed, passes)
    return machine.emit_object(parsed)


def compiled():
    """The tile symbols this process compiled (the others it uses came from the cache)."""
    return frozenset(_compiled)


def _register(symbol, obj):
    engine = _engine()
    engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
    engine.finalize_object()
    address = engine.get_function_address(symbol)
    if not address:
        raise RuntimeError(f"{symbol} is not in its object code")
    llvm.add_symbol(symbol, address)
    _ready[symbol] = obj


def declare(module, symbol, fnty):
    """The external declaration of ``symbol`` in ``module`` (added once)."""
    fn = module.globals.get(symbol)
    if fn is None:
        fn = ir.Function(module, fnty, symbol)
    return fn
