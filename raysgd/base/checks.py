"""Argument checks: the one checker, whose error names the argument, what it expects and what it was given.

Layer -1 (standard library only), so that every layer checks its arguments the same way. A message reads
``<argument> expects <expected>; got <value>``, where the argument is named as its owner writes it:
``TorchTrainer: num_workers`` (``caller``), ``ScalingConfig(num_workers=...)`` (``call=True``) or just
``num_steps``; the value is its ``repr`` (``typed=True`` puts its type first, for values whose ``repr`` alone
could mislead, such as ``'2'``), or a text of the caller's (``got=``, e.g. which item of a list is wrong).

Example:
    >>> expect(False, "num_workers", "an int >= 1", 0, caller="TorchTrainer")
    Traceback (most recent call last):
    ValueError: TorchTrainer: num_workers expects an int >= 1; got 0
    >>> expect(is_int("2", 1), "num_workers", "an int >= 1", "2", TypeError, caller="ScalingConfig", call=True,
    ...        typed=True)
    Traceback (most recent call last):
    TypeError: ScalingConfig(num_workers=...) expects an int >= 1; got str '2'
"""
import inspect
import math
import numbers
import threading

#: The largest ``timeout_s`` raysgd takes (``TorchTrainer``'s, ``raysgd.train.TorchConfig``'s): the longest wait a
#: thread takes (``threading.TIMEOUT_MAX``; the process group's ``datetime.timedelta`` holds more). An infinite
#: timeout would fail in the workers, once they had started: ``is_number(value, maximum=MAX_TIMEOUT_S)``.
MAX_TIMEOUT_S = threading.TIMEOUT_MAX
import os


def is_int(value, minimum=None):
    """Whether ``value`` is an int (``bool`` is not) and at least ``minimum`` when one is given.

    Example:
        >>> is_int(3, 1), is_int(True), is_int(2.0), is_int(0, minimum=1)
        (True, False, False, False)
    """
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and (minimum is None or bool(value >= minimum)))  # numpy compares to np.True_


def is_whole(value, minimum=None):
    """Whether ``value`` is a whole number, at least ``minimum`` when one is given: an int (:func:`is_int`) or a
    float without a fraction (``2.0``, as Ray Tune's quantized search spaces give); a count takes ``int(value)``.

    Example:
        >>> is_whole(2.0), is_whole(2.5), is_whole(True), is_whole(float("inf")), is_whole(0.0, minimum=1)
        (True, False, False, False, False)
    """
    return is_int(value, minimum) or (is_number(value, minimum, finite=True) and float(value).is_integer())


def is_number(value, minimum=None, above=None, finite=False, maximum=None):
    """Whether ``value`` is a real number (``bool`` is not), at least ``minimum``, above ``above`` and at most
    ``maximum`` when given, and neither infinite nor NaN when ``finite`` (or ``maximum``).

    Example:
        >>> is_number(0.5, above=0), is_number(0, above=0), is_number("1"), is_number(False)
        (True, False, False, False)
        >>> is_number(float("inf"), above=0), is_number(float("inf"), above=0, finite=True), is_number(5, maximum=4)
        (True, False, False)
    """
    return bool(isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy compares to np.True_
                and (minimum is None or value >= minimum) and (above is None or value > above)
                and (maximum is None or value <= maximum) and (not finite or math.isfinite(value)))


def plain(value):
    """A checked number as Python's own ``int`` or ``float``; anything else (``bool`` too) unchanged.

    :func:`is_int` and :func:`is_number` accept numpy's scalars, which much of what a value is handed to refuses
    (``datetime.timedelta``, torch's ``DataLoader`` batch size, ``json``): a checker returns ``plain(value)``.

    Example:
        >>> import fractions
        >>> plain(2), plain(fractions.Fraction(1, 2)), plain(True), plain("2")
        (2, 0.5, True, '2')
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def plain_json(value):
    """``value`` as JSON holds it, as a checkpoint's marker keeps it and a resumed run reads it back: dicts (their
    keys as str) and lists or tuples (as lists) item by item, bools, ints and floats as Python's (a numpy or
    one-element tensor value as its number), strings and None as they are, anything else (a complex, a tensor of
    several values, a path) as its repr.

    Example:
        >>> import numpy as np
        >>> plain_json({"acc": np.float32(0.75), 3: (np.int64(2), np.bool_(True)), "z": 1j})
        {'acc': 0.75, '3': [2, True], 'z': '1j'}
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, dict):
        return {key if isinstance(key, str) else str(key): plain_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(item) for item in value]
    if isinstance(value, numbers.Real):  # numpy's too: JSON writes only Python's
        return plain(value)
    if not isinstance(value, numbers.Number) and hasattr(value, "item") and (
            getattr(value, "ndim", None) == 0 or getattr(value, "size", None) == 1
            or (callable(getattr(value, "numel", None)) and value.numel() == 1)):
        return plain_json(value.item())  # a numpy bool, a 0-d array, a one-element tensor
    return repr(value)


def is_one_of(value, choices):
    """Whether ``value`` is one of ``choices`` (a set, a tuple); a value that cannot be looked up (a list given for
    a name: unhashable; an array: no single truth value) is not, rather than an error inside the check.

    Example:
        >>> is_one_of("batch", {"batch", "epoch"}), is_one_of(["batch"], {"batch", "epoch"})
        (True, False)
    """
    try:
        return bool(value in choices)
    except (TypeError, ValueError):
        return False


def takes_no_arguments(function):
    """Whether callable ``function`` can be called with no arguments (its signature binds none); True where Python
    cannot tell (a builtin without a signature).

    Example:
        >>> takes_no_arguments(lambda: None), takes_no_arguments(lambda config: None), takes_no_arguments(print)
        (True, False, True)
    """
    try:
        inspect.signature(function).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def argument(name, caller=None, call=False):
    """How a message names argument ``name`` of ``caller``: ``caller: name``, ``caller(name=...)`` (``call``), or
    ``name`` alone.

    Example:
        >>> argument("tags", "MLflowLogger"), argument("path", "Checkpoint", call=True), argument("num_steps")
        ('MLflowLogger: tags', 'Checkpoint(path=...)', 'num_steps')
    """
    if caller is None:
        return name
    return f"{caller}({name}=...)" if call else f"{caller}: {name}"


def message(name, expected, value, *, caller=None, call=False, typed=False, got=None):
    """``<argument> expects <expected>; got <value>`` (see the module docstring); ``got``: the text shown for the
    value instead of its ``repr``.

    Example:
        >>> message("num_steps", "None or an int >= 0", 2.5)
        'num_steps expects None or an int >= 0; got 2.5'
        >>> message("callbacks", "a list", [3], caller="RunConfig", call=True, got="[3] (item 0 is int 3)")
        'RunConfig(callbacks=...) expects a list; got [3] (item 0 is int 3)'
    """
    if got is None:
        got = f"{type(value).__name__} {value!r}" if typed else repr(value)
    return f"{argument(name, caller, call)} expects {expected}; got {got}"


def argument_error(name, expected, value, error=ValueError, **how):
    """The exception :func:`expect` raises (``how``: :func:`message`'s keywords), for a caller that raises it
    itself (``raise argument_error(...) from err``).

    Example:
        >>> argument_error("timeout_s", "seconds > 0", -1, caller="TorchTrainer")
        ValueError('TorchTrainer: timeout_s expects seconds > 0; got -1')
    """
    return error(message(name, expected, value, **how))


def expect(condition, name, expected, value, error=ValueError, caller=None, **how):
    """Raise ``error`` naming the argument, what it expects and what it was given, unless ``condition``.

    ``caller`` names the argument's owner; ``how``: ``call``, ``typed`` and ``got`` (see :func:`message`).

    Example:
        >>> expect(True, "timeout_s", "a number of seconds > 0", 5)
        >>> expect(False, "timeout_s", "a number of seconds > 0", 0, caller="TorchTrainer")
        Traceback (most recent call last):
        ValueError: TorchTrainer: timeout_s expects a number of seconds > 0; got 0
    """
    if not condition:
        raise argument_error(name, expected, value, error, caller=caller, **how)


def is_path(value):
    """Whether ``value`` is a non-empty path or URI: a ``str`` or an ``os.PathLike`` (``bytes`` is not).

    Example:
        >>> import pathlib
        >>> is_path("/tmp/run"), is_path(pathlib.Path("run")), is_path(""), is_path(b"/tmp"), is_path(3)
        (True, True, False, False, False)
    """
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        return False
    text = os.fspath(value)
    return isinstance(text, str) and bool(text)
