"""The epoch's order: a sampler's stream drawn as a function of ``(seed, epoch)``, and whether it repeats.

Layer 1: imports torch (and numpy, only to isolate its global random stream). No Ray, no process group.

The data cursor (:mod:`raysgd.torch.sharding.cursor`) needs the epoch's *global stream*, the loader's own sampler
(or batch sampler) iterated once, to be the same list on every rank and again after a restart. It is
drawn with every random stream the sampler could use seeded from ``(seed, epoch)``: a ``generator``
attribute (of the sampler or of a batch sampler's inner sampler) and the process's global streams
(torch CPU, numpy, Python ``random``), which are saved and restored around the draw, so drawing never
shifts them.

A sampler that shuffles with a random object of its own (``random.Random(seed)`` or
``np.random.default_rng(seed)`` kept from ``__init__``) draws a new order each time, whatever raysgd
seeds: after a restart the epoch would be read in another order than the one the cursor counted.
:func:`draws_repeat` finds such a sampler by drawing twice and comparing.

Example:
    >>> import random
    >>> from torch.utils.data import RandomSampler, Sampler
    >>> class OwnRandom(Sampler):
    ...     def __init__(self):
    ...         self.rng = random.Random(0)
    ...     def __iter__(self):
    ...         return iter(self.rng.sample(range(8), 8))
    ...     def __len__(self):
    ...         return 8
    >>> draws_repeat(RandomSampler(range(8)), seed=3), draws_repeat(OwnRandom(), seed=3)
    (True, False)
"""
import contextlib
import hashlib
import itertools
import random
import types
from typing import Iterator

import torch

from raysgd.base import environment

_END = object()


def epoch_seed(seed, epoch):
    """A 63-bit seed for ``(seed, epoch)``: pairs never collide the way ``seed + epoch`` does.

    Example:
        >>> epoch_seed(0, 1) == epoch_seed(1, 0)
        False
    """
    digest = hashlib.sha256(f"raysgd-cursor:{int(seed)}:{int(epoch)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def isolated_random_streams(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator, numpy's and Python's global streams with ``seed``; restore them after.

    CUDA generators are never touched (a sampler draws on the CPU).

    Example:
        >>> before = torch.get_rng_state()
        >>> with isolated_random_streams(3):
        ...     a = torch.rand(1)
        >>> with isolated_random_streams(3):
        ...     b = torch.rand(1)
        >>> bool(torch.equal(a, b)), bool(torch.equal(before, torch.get_rng_state()))
        (True, True)
    """
    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    np: types.ModuleType | None  # numpy, or None without it
    try:
        import numpy as np  # noqa: PLC0415 (optional: only to leave numpy's stream as it was)
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        np = None
    numpy_state = np.random.get_state() if np is not None else None
    try:
        torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that would reseed CUDA too
        random.seed(seed)
        if np is not None:
            np.random.seed(seed % 2**32)
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        if np is not None:
            np.random.set_state(numpy_state)


def _generator_holders(base):
    """The objects (the sampler, a batch sampler's inner sampler) whose ``generator`` attribute is a
    ``torch.Generator`` or None (torch's samplers then draw one from torch's stream). Another object there (numpy's
    ``default_rng``, a ``random.Random``) is the sampler's own and left alone: a torch generator in its place broke
    the sampler (``'Generator' object has no attribute 'permutation'``)."""
    holders = []
    for obj in (base, getattr(base, "sampler", None)):
        attributes = getattr(obj, "__dict__", {}) if obj is not None else {}
        if "generator" in attributes and (attributes["generator"] is None
                                          or isinstance(attributes["generator"], torch.Generator)):
            holders.append(obj)
    return holders


@contextlib.contextmanager
def seeded(base, seed, epoch):
    """Inside: ``base``'s generators and the global streams seeded from ``(seed, epoch)``; all put back after.

    ``base.set_epoch(epoch)`` is called first when ``base`` has it.

    Example:
        >>> from torch.utils.data import RandomSampler
        >>> with seeded(RandomSampler(range(5)), seed=1, epoch=0):
        ...     a = torch.rand(1)
        >>> with seeded(RandomSampler(range(5)), seed=1, epoch=0):
        ...     b = torch.rand(1)
        >>> bool(a == b)
        True
    """
    derived = epoch_seed(seed, epoch)
    if hasattr(base, "set_epoch"):
        base.set_epoch(epoch)
    holders = _generator_holders(base)
    saved = [holder.generator for holder in holders]
    try:
        for holder in holders:
            holder.generator = torch.Generator().manual_seed(derived)
        with isolated_random_streams(derived):
            yield
    finally:
        for holder, generator in zip(holders, saved):
            holder.generator = generator


class StreamTooLong(ValueError):
    """Raised by :func:`draw_stream` for a stream longer than its ``limit``.

    Example:
        >>> issubclass(StreamTooLong, ValueError)
        True
    """


def draw_stream(base, seed, epoch, limit=None):
    """The list ``base`` yields in ``epoch``: a deterministic function of ``(seed, epoch)``.

    A ``generator`` attribute of ``base`` (or of its inner ``sampler``) is replaced by a fresh generator
    seeded from ``(seed, epoch)`` during the draw, the global streams are isolated the same way, and
    ``base.set_epoch(epoch)`` is called first when ``base`` has it. A stream longer than ``limit``
    (default ``SGD_MAX_CURSOR_POSITIONS``) raises :class:`StreamTooLong` after ``limit + 1`` positions.

    Example:
        >>> from torch.utils.data import RandomSampler
        >>> draw_stream(RandomSampler(range(6)), 1, 0) == draw_stream(RandomSampler(range(6)), 1, 0)
        True
    """
    most = environment.get("SGD_MAX_CURSOR_POSITIONS")
    limit = most if limit is None else limit
    with seeded(base, seed, epoch):
        stream = list(itertools.islice(iter(base), limit + 1))
    if len(stream) > limit:
        raise StreamTooLong(f"{type(base).__name__} yielded more than {limit} positions in epoch {epoch}: the "
                            f"data cursor draws an epoch whole, up to SGD_MAX_CURSOR_POSITIONS={most}")
    return stream


def stream_length(base):
    """``len(base)``, or None when ``base`` has no length (an endless sampler, a generator-like one).

    Example:
        >>> stream_length(range(3)), stream_length(iter(range(3)))
        (3, None)
    """
    try:
        return len(base)
    except (TypeError, NotImplementedError):
        return None


def draws_repeat(base, seed, epoch=0, limit=None):
    """Whether ``base`` yields the same stream when drawn twice for ``(seed, epoch)`` (see the module docstring).

    The first draw is kept, the second compared with it as it comes. A stream longer than ``limit``
    raises :class:`StreamTooLong`, as :func:`draw_stream` does.
    """
    first = draw_stream(base, seed, epoch, limit)
    with seeded(base, seed, epoch):
        second = iter(base)
        for expected in first:
            item = next(second, _END)
            if item is _END or not _same(item, expected):
                return False
        return next(second, _END) is _END  # a longer second draw differs too


def _same(a, b):
    """``a == b`` for the items a sampler yields: ints, lists of them, or tensors and arrays."""
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # a tensor or array of several elements
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
