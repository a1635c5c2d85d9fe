"""torch tensors through the numpy faces: numpy views in, tensors out, no copy either way.

torch is never imported here: a tensor can only exist once its caller imported torch,
so the module is looked up in ``sys.modules``.  A CPU tensor's memory is shared with
the numpy view the kernels read (and, for ``out=`` and gemm's ``c``, write), and the
result array becomes a tensor with ``torch.from_numpy``.

tilegemm records no gradients.  A tensor that requires grad is refused while torch's
gradient mode is on (the result would silently leave the graph) and read through
``detach()`` under ``torch.no_grad()`` or ``torch.inference_mode()``, which is how
inference code calls a module's weights.
"""
import sys

import numpy as np


def is_tensor(x):
    """Whether ``x`` is a ``torch.Tensor`` (False whenever torch was never imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def any_tensor(*xs):
    """Whether any of ``xs`` is a tensor."""
    return "torch" in sys.modules and any(is_tensor(x) for x in xs)


def numpy_view(x, name, func, written=False):
    """``x`` itself unless it is a tensor; a tensor's data as an ndarray sharing its memory.

    ``written``: ``x`` is a destination (``out=``, gemm's ``c``), so it must be its
    own memory, not a lazily negated view that only a copy could resolve.

    Raises
    ------
    TypeError
        For a tensor off the CPU, one that requires grad while gradient mode is on, or
        one whose dtype numpy has no equivalent of (bfloat16).
    """
    if not is_tensor(x):
        return x
    torch = sys.modules["torch"]
    if x.device.type != "cpu":
        raise TypeError(f"{func}: {name} is a tensor on {x.device}; tilegemm computes on the "
                        "CPU (pass .cpu())")
    if x.requires_grad:
        if torch.is_grad_enabled():
            raise TypeError(f"{func}: {name} requires grad and tilegemm records no gradients; "
                            "call it under torch.no_grad() or pass .detach()")
        x = x.detach()
    if x.is_neg():
        if written:
            raise TypeError(f"{func}: {name} is a lazily negated tensor view; tilegemm cannot "
                            "write through it (pass a plain tensor)")
        x = x.resolve_neg()              # a lazily negated view: numpy would see the sign lost
    try:
        return x.numpy()
    except TypeError as exc:             # e.g. bfloat16
        raise TypeError(f"{func}: {name} is a tensor of {x.dtype}, which numpy cannot view "
                        f"({exc}); tilegemm computes in float32 and float64") from None


def to_tensor(result):
    """The ndarray (or numpy scalar) ``result`` as a tensor sharing its memory."""
    return sys.modules["torch"].from_numpy(np.asarray(result))
