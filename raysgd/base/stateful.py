"""The one protocol of what a checkpoint holds: a component that saves and restores itself.

Layer -1 (standard library only). Everything a checkpoint keeps (the operator, the data cursor, the random streams,
the callbacks, the result log) is a :class:`Stateful`: ``state_dict()`` returns its state as plain values and
``load_state_dict(state)`` puts it back, as torchtitan's checkpoint manager treats its components. Whoever owns a
set of components saves and restores them as one named mapping (:func:`state_dicts`, :func:`load_state_dicts`):
no component is a special case, and the code that writes the states (storage) never calls into them.

Example:
    >>> class Counter:
    ...     def __init__(self):
    ...         self.n = 0
    ...     def state_dict(self):
    ...         return {"n": self.n}
    ...     def load_state_dict(self, state):
    ...         self.n = state["n"]
    >>> counter = Counter(); counter.n = 3
    >>> isinstance(counter, Stateful)
    True
    >>> saved = state_dicts({"counter": counter})
    >>> fresh = Counter()
    >>> load_state_dicts({"counter": fresh}, saved), fresh.n
    (['counter'], 3)
"""
import typing

from raysgd.base.checks import expect


@typing.runtime_checkable
class Stateful(typing.Protocol):
    """Saves and restores itself: ``load_state_dict(state_dict())`` leaves it as it was.

    ``state_dict()`` returns plain values (dicts, lists, numbers, strings, bytes, tensors), or None when there is
    nothing to keep; ``load_state_dict(state)`` takes what an earlier ``state_dict()`` returned (also, where the
    component says so, an older form of it).

    Example:
        >>> isinstance(object(), Stateful)
        False
    """

    def state_dict(self) -> typing.Any:
        """This component's state as plain values (None: nothing to keep)."""

    def load_state_dict(self, state: typing.Any) -> None:
        """Restore what :meth:`state_dict` returned."""


def check_components(components, caller="state_dicts"):
    """``components`` as a dict ``{name: Stateful}``; a name that is not a string, or a value without
    ``state_dict``/``load_state_dict``, raises ``TypeError`` naming it.

    Example:
        >>> check_components({"x": object()})
        Traceback (most recent call last):
        TypeError: state_dicts: components expects a mapping of names to Stateful objects (state_dict and load_state_dict); got 'x': object
    """
    if components is None:
        return {}
    expected = "a mapping of names to Stateful objects (state_dict and load_state_dict)"
    expect(isinstance(components, typing.Mapping), "components", expected, components, TypeError, caller=caller,
           got=type(components).__name__)
    for name, component in components.items():
        expect(isinstance(name, str) and isinstance(component, Stateful), "components", expected, components,
               TypeError, caller=caller, got=f"{name!r}: {type(component).__name__}")
    return dict(components)


def state_dicts(components):
    """``{name: component.state_dict()}`` of a named mapping of :class:`Stateful` components, in its order.

    Example:
        >>> state_dicts({})
        {}
    """
    return {name: component.state_dict() for name, component in check_components(components).items()}


def load_state_dicts(components, states):
    """Hand each component of ``components`` its state in ``states`` (a mapping by the same names, such as what
    :func:`state_dicts` returned), in the components' order; a component whose state is missing or None is left as
    it is. Returns the names loaded.

    Example:
        >>> load_state_dicts({}, {"other": 1})
        []
    """
    components = check_components(components, "load_state_dicts")
    loaded = []
    for name, component in components.items():
        state = (states or {}).get(name)
        if state is not None:
            component.load_state_dict(state)
            loaded.append(name)
    return loaded
