"""How raysgd hands bytes and code to Ray: a buffer sent out of band with no copy (:func:`out_of_band`), and a class
or function sent by value (:func:`by_value`), so a 0-CPU helper's process imports only what its code uses.

Layer 3 (the standard library and numpy; Ray does the sending). Every buffer raysgd puts into an object store goes
through :func:`out_of_band`; the 0-CPU helpers (the commit store, the part holders, the restart points' copy and
read tasks, the progress bar's mailbox, the rank files' tasks) are made from :func:`by_value` copies.

Example:
    >>> bytes(out_of_band(b"abc").raw())
    b'abc'
"""
import pickle
import types

import numpy


def out_of_band(buffer):
    """``buffer`` (any contiguous bytes-like object) wrapped for Ray to send out of band, with no copy
    (``pickle.PickleBuffer``): over ``buffer`` itself when it is ``bytes``, else over a numpy array of its bytes,
    never over a ``memoryview``. Every buffer raysgd hands to Ray goes through here.

    Why: a ``PickleBuffer`` is a garbage-collected object. When it and the ``memoryview`` it took its buffer from
    end up in one reference cycle (a failed Ray call's traceback holds the frames that hold both: a commit sent to a
    lost store or holder), CPython's collector may clear the memoryview first, which cannot be released while
    exported ("BufferError: memoryview has 1 exported buffer"), and the process then dies of a segmentation fault.
    A numpy array is not tracked by the collector, so what it exports is never cleared under it.

    Example:
        >>> bytes(out_of_band(memoryview(b"abc").toreadonly()).raw()), out_of_band(b"abc").raw().nbytes
        (b'abc', 3)
    """
    if isinstance(buffer, bytes):
        return pickle.PickleBuffer(buffer)
    array = numpy.frombuffer(buffer, dtype=numpy.uint8)
    return pickle.PickleBuffer(array)  # type: ignore[arg-type]  # numpy: a Buffer on 3.12+ only


def _names(code):
    """The global names ``code`` and the code nested in it (comprehensions, lambdas) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def by_value(obj):
    """A copy of ``obj``, a class (its methods copied too) or a function, that Ray sends by value, as it sends one of
    ``__main__``.

    Ray sends a class or function of an importable module by reference: the process that runs it imports that module
    and, with it, its package (``raysgd`` imports torch: about 1.2 CPU seconds, several under load, and a 1-CPU node
    starts one worker process at a time). The 0-CPU helpers that need no torch (the commit store, the part holders,
    the restart point's copy task, the progress bar's mailbox) are made from such a copy, so their processes import
    only what their code uses.
    cloudpickle sends each function with the module globals it names: builtins, constants, loggers and modules such as
    ``ray``, ``pickle`` or ``numpy`` go as they are; a function of a ``raysgd`` module it names (:func:`out_of_band`)
    is copied by value too (by reference it would bring the import back); a class of a ``raysgd`` module must not be
    named.

    Example:
        >>> class Box:
        ...     def get(self):
        ...         return 1
        >>> copy = by_value(Box)
        >>> copy is not Box and copy.__qualname__ == Box.__qualname__ and copy().get() == 1
        True
        >>> by_value(len) is len, by_value(out_of_band) is not out_of_band
        (True, True)
    """
    if isinstance(obj, types.FunctionType):  # a copy: the module's own function would go by reference
        named = _names(obj.__code__)
        ours = {name: by_value(value) for name, value in obj.__globals__.items()
                if name in named and isinstance(value, types.FunctionType) and value is not obj
                and (value.__module__ or "").startswith("raysgd.")}  # (none of them calls back: no cycle to guard)
        scope = {**obj.__globals__, **ours} if ours else obj.__globals__
        copy = types.FunctionType(obj.__code__, scope, obj.__name__, obj.__defaults__, obj.__closure__)
        copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = obj.__kwdefaults__, obj.__qualname__, obj.__doc__
        return copy
    if not isinstance(obj, type):
        return obj
    namespace = {name: by_value(value) for name, value in vars(obj).items() if name not in ("__dict__", "__weakref__")}
    return type(obj.__name__, obj.__bases__, namespace)
