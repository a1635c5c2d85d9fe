"""Calls of a jitted function whose argument types repeat, without Numba's typing.

Numba's dispatcher types every argument of every call to pick the compiled
overload: a fingerprint of each array and of each tuple's items.  A quantized
layer's kernel takes some fifty values, 26 of them arrays, and its dispatch took
2.3 us of a 25 us call (ResNet-18's 1x1 stride-2 shortcut in int8, one thread),
of which typing was about half.  The types of such a call change only with what
its caller already knows (an input's flags, say): :class:`Entries` keeps the
compiled entry point (the CPython wrapper the dispatcher itself calls) of each
such key, found by one call through the dispatcher, and calls it directly after.
The wrapper still unboxes each argument by its compiled type: a key must name
everything that could change the types (dtype, dimensions, layout, alignment,
writeability of each array; the types of the other values).
"""


class Entries:
    """The compiled entry points of ``dispatcher``, one per caller's key.

    Parameters
    ----------
    dispatcher : numba Dispatcher
    """

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._entries = {}

    def __call__(self, key, *args):
        """``dispatcher(*args)``: through the entry point of ``key`` once one is known,
        else through the dispatcher (which compiles what it must), keeping the entry
        point of the overload whose types are exactly the arguments'."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry(*args)
        result = self.dispatcher(*args)
        signature = tuple(self.dispatcher.typeof_pyval(a) for a in args)
        compiled = self.dispatcher.overloads.get(signature)
        if compiled is not None:        # else (a conversion picked it): always dispatched
            self._entries[key] = compiled.entry_point
        return result
