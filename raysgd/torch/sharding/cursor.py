"""The data cursor: which positions of an epoch's index stream each rank reads, and how many are consumed.

Layer 1: imports torch and :mod:`raysgd.torch.sharding.epoch_order`. No Ray, no process group.

The epoch's *global stream* is the loader's own sampler (or batch sampler) iterated once, with every
random stream it could use seeded from ``(seed, epoch)`` (:func:`~raysgd.torch.sharding.epoch_order.draw_stream`):
the same list on every rank, and a replay of it after a failure.

Rank ``r`` of ``W`` reads the stream's positions ``start + r, start + r + W, ...``, where the **cursor**
``start`` counts the positions already consumed by all ranks together. After ``k`` full batches of
``b`` items on every rank, exactly the first ``start + k * b * W`` positions are consumed
(:meth:`ShardSampler.position_after`); a restart at that cursor, on any number of ranks, reads each
remaining position exactly once.

The tail of a training epoch (``lockstep=True``: every rank must run the same number of batches,
because DDP steps together). Let ``R`` be the positions left and ``t = R mod (W * b)``:

* ``drop_last``: every rank reads ``R // (W * b)`` full batches; the last ``t`` positions are skipped
  (as ``DataLoader(drop_last=True)`` does on one process).
* otherwise, with ``t == 0`` or ``t >= W``: every position is read exactly once; the last batch of
  each rank is partial.
* otherwise (``0 < t < W``, e.g. ``b == 1`` and ``R`` not a multiple of ``W``, or fewer positions
  than ranks): ranks ``t..W-1`` would run one batch fewer, so each of them also reads one position
  from the start of what was left. Those ``W - t`` samples are trained twice in that epoch; this is
  the only case where exactly-once does not hold, and no fixed batch size can avoid it.

Validation (``lockstep=False``) is exact: ``start + r, start + r + W, ...`` up to the end, unpadded,
so ranks may differ by one item (and by one batch). With ``drop_last`` the end is where one process
stops: after the last full batch, ``start + (R // b) * b`` (each rank's loader then keeps its partial
batch), so N ranks validate exactly what one process validates.

An epoch's stream is drawn whole only up to ``SGD_MAX_CURSOR_POSITIONS`` positions
(:mod:`raysgd.torch.constants`). An endless sampler (no length, e.g. detectron2's ``TrainingSampler``),
a longer one, or one whose draws do not repeat (:func:`~raysgd.torch.sharding.epoch_order.draws_repeat`) is read
by a :class:`StreamShardSampler` instead: lazily, rank ``r`` taking positions ``r, r + W, ...`` as the
stream goes, with no cursor (see :func:`raysgd.torch.sharding.loaders.shard_loader`).

Example:
    >>> list(shard_positions(10, 0, rank=1, world_size=3))
    [1, 4, 7]
    >>> list(shard_positions(10, 4, rank=0, world_size=3))
    [4, 7]
    >>> from torch.utils.data import SubsetRandomSampler
    >>> shards = [ShardSampler(SubsetRandomSampler([2, 4, 6, 8, 10]), r, 2, seed=7) for r in (0, 1)]
    >>> sorted(list(shards[0]) + list(shards[1]))
    [2, 4, 6, 8, 10]
    >>> shards[0].position_after(num_batches=1, batch_size=2)
    4
"""
import itertools
import logging

from torch.utils.data import Sampler

from raysgd.base.checks import expect, is_int
from raysgd.torch.sharding.epoch_order import draw_stream, seeded, stream_length

logger = logging.getLogger(__name__)
_END = object()


def _cursor_int(value):
    """An int >= 0 (an epoch, a cursor), numpy's too; it is kept as ``int(value)``: it goes into JSON markers,
    where numpy's ints do not."""
    return is_int(value, 0)


def shard_positions(total, start, rank, world_size, *, batch_size=1, drop_last=False, lockstep=False):
    """The stream positions rank ``rank`` of ``world_size`` reads, from cursor ``start`` of ``total``.

    ``lockstep=False`` (validation): exact, unpadded (``drop_last``: up to one process's last full batch).
    ``lockstep=True`` (training): every rank gets the same number of batches of ``batch_size``; see the
    module docstring for how the tail is dealt.

    Example:
        >>> [list(shard_positions(5, 0, r, 2, batch_size=1, lockstep=True)) for r in (0, 1)]
        [[0, 2, 4], [1, 3, 0]]
        >>> [list(shard_positions(7, 0, r, 2, batch_size=2, lockstep=True)) for r in (0, 1)]
        [[0, 2, 4, 6], [1, 3, 5]]
        >>> [list(shard_positions(10, 1, r, 2, batch_size=2, drop_last=True, lockstep=True)) for r in (0, 1)]
        [[1, 3, 5, 7], [2, 4, 6, 8]]
        >>> [list(shard_positions(10, 0, r, 3, batch_size=4, drop_last=True)) for r in (0, 1, 2)]
        [[0, 3, 6], [1, 4, 7], [2, 5]]
    """
    _check_shard_args(total, start, rank, world_size, batch_size)
    total, start, rank, world_size, batch_size = (int(v) for v in (total, start, rank, world_size, batch_size))
    positions, pad = _plan(total, start, rank, world_size, batch_size, drop_last, lockstep)
    return positions if pad is None else [*positions, pad]


def _plan(total, start, rank, world_size, batch_size, drop_last, lockstep):
    """``(positions, pad)``: a range of positions, then one more (``pad``, earlier in the stream) or None."""
    left = total - start
    if not lockstep:  # exact; drop_last ends where one process would (after its last full batch)
        return range(start + rank, start + left // batch_size * batch_size if drop_last else total, world_size), None
    per_round = world_size * batch_size
    if drop_last:
        return range(start + rank, start + (left // per_round) * per_round, world_size), None
    tail = left % per_round
    pad = start + (rank - tail) % left if 0 < tail < world_size and rank >= tail else None
    return range(start + rank, total, world_size), pad


def _check_shard_args(total, start, rank, world_size, batch_size):
    for name, value in (("total", total), ("start", start), ("rank", rank), ("world_size", world_size),
                        ("batch_size", batch_size)):
        if not is_int(value):
            raise TypeError(f"shard_positions: {name} must be an int; got {type(value).__name__} {value!r}")
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"shard_positions: world_size and batch_size must be >= 1; got {world_size}, {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_positions: rank must be in [0, {world_size}); got {rank}")
    if not 0 <= start <= total:
        raise ValueError(f"shard_positions: the cursor start must be in [0, total={total}]; got {start}")


class DataCursor:
    """Where a training epoch stopped, as a :class:`~raysgd.base.stateful.Stateful` component: the ``epoch``, the
    positions of its stream ``consumed`` by all ranks together, the ``steps`` (batches) trained in it and the
    ``call_steps`` of the call that took it; ``tags`` (such as the commit's ``attempt`` and ``call``) are kept as
    given. ``state_dict()`` is the training state's ``cursor``; ``load_state_dict`` checks one (a field that is not
    an int >= 0 raises naming it; ``call_steps`` defaults to 0).

    Example:
        >>> cursor = DataCursor.of({"epoch": 2, "consumed": 16, "steps": 2})
        >>> cursor.consumed, cursor.state_dict()
        (16, {'epoch': 2, 'consumed': 16, 'steps': 2, 'call_steps': 0})
        >>> DataCursor.of({"epoch": 2, "consumed": -1, "steps": 0})
        Traceback (most recent call last):
        ValueError: DataCursor: consumed expects an int >= 0; got -1
    """

    FIELDS = ("epoch", "consumed", "steps", "call_steps")

    def __init__(self, epoch=0, consumed=0, steps=0, call_steps=0, **tags):
        self.load_state_dict({"epoch": epoch, "consumed": consumed, "steps": steps, "call_steps": call_steps, **tags})

    @classmethod
    def of(cls, state):
        """A cursor loaded from ``state`` (what :meth:`state_dict` returned)."""
        cursor = cls.__new__(cls)
        cursor.load_state_dict(state)
        return cursor

    def state_dict(self):
        """``{"epoch", "consumed", "steps", "call_steps", **tags}``: plain ints (they may go into JSON markers)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "steps": self.steps, "call_steps": self.call_steps,
                **self.tags}

    def load_state_dict(self, state):
        """Take the fields of ``state`` (checked; see the class docstring)."""
        expect(isinstance(state, dict), "state", "a dict with epoch, consumed and steps", state, TypeError,
               caller="DataCursor")
        state = {"call_steps": 0, **state}
        for name in self.FIELDS:
            expect(_cursor_int(state.get(name)), name, "an int >= 0", state.get(name), caller="DataCursor")
        self.epoch, self.consumed, self.steps, self.call_steps = (int(state[name]) for name in self.FIELDS)
        self.tags = {key: value for key, value in state.items() if key not in self.FIELDS}

    def __repr__(self):
        return f"DataCursor({self.state_dict()!r})"


class ShardSampler(Sampler):
    """This rank's share of ``base``'s stream for the current epoch, from the cursor :attr:`start`.

    ``base`` is the loader's own sampler (``batch_size`` = the loader's batch size) or its custom batch
    sampler (``batch_size=1``: then each item is a batch and the cursor counts batches). ``lockstep``:
    training (same batch count on every rank) or validation (exact shards).

    Attributes: ``base``, ``rank``, ``world_size``, ``seed``, ``batch_size``, ``drop_last``,
    ``lockstep``, ``epoch`` (set by :meth:`set_epoch`), ``start`` (the cursor this pass starts from) and
    :attr:`total` (positions in the epoch's stream).

    Example:
        >>> from torch.utils.data import SequentialSampler
        >>> shard = ShardSampler(SequentialSampler(range(10)), rank=1, world_size=2, batch_size=2)
        >>> shard.set_start(4)
        >>> list(shard), shard.position_after(1), shard.total
        ([5, 7, 9], 8, 10)
        >>> list(shard)  # a new pass starts at 0 unless set_start is called again
        [1, 3, 5, 7, 9]
    """

    def __init__(self, base, rank, world_size, *, seed=0, batch_size=1, drop_last=False, lockstep=False):
        _check_shard_args(0, 0, rank, world_size, batch_size)
        if not is_int(seed):
            raise TypeError(f"ShardSampler: seed must be an int; got {type(seed).__name__} {seed!r}")
        self.base = base
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.lockstep = bool(lockstep)
        self.epoch = 0
        self.set_epoch_calls = 0  # how often set_epoch was called (a caller that sets the same epoch again is seen)
        self.start = 0
        self._pinned = False  # set_start was called for the next pass
        self._stream = None  # (epoch, list) of the latest draw

    def set_epoch(self, epoch):
        """Use ``epoch``'s stream from the next pass; the cursor goes back to 0 unless :meth:`set_start` set it."""
        expect(_cursor_int(epoch), "ShardSampler.set_epoch", "an int >= 0", epoch)
        self.epoch = int(epoch)
        self.set_epoch_calls += 1
        if not self._pinned:
            self.start = 0

    def set_start(self, consumed):
        """Start the next pass at the global cursor ``consumed`` (positions already read by all ranks)."""
        expect(_cursor_int(consumed), "ShardSampler.set_start", "an int >= 0 (a cursor)", consumed)
        self.start = int(consumed)
        self._pinned = True

    def stream(self):
        """The current epoch's global stream (drawn once per epoch and kept)."""
        if self._stream is None or self._stream[0] != self.epoch:
            self._stream = (self.epoch, draw_stream(self.base, self.seed, self.epoch))
        return self._stream[1]

    @property
    def total(self):
        """Positions in the current epoch's stream."""
        return len(self.stream())

    def positions(self):
        """This rank's positions for the pass starting at :attr:`start`."""
        total = self.total
        if self.start > total:
            raise ValueError(f"the data cursor {self.start} is past the end of epoch {self.epoch}'s stream of "
                             f"{total} positions: was it recorded for another dataset or sampler?")
        return shard_positions(total, self.start, self.rank, self.world_size, batch_size=self.batch_size,
                               drop_last=self.drop_last, lockstep=self.lockstep)

    def position_after(self, num_batches, batch_size=None):
        """The global cursor after ``num_batches`` batches of ``batch_size`` (default: ours) on every rank."""
        batch_size = self.batch_size if batch_size is None else batch_size
        expect(num_batches >= 0 and batch_size >= 1, "position_after", "num_batches >= 0 and batch_size >= 1",
               (num_batches, batch_size), got=f"{num_batches}, {batch_size}")
        return int(min(self.start + num_batches * batch_size * self.world_size, self.total))

    def __iter__(self):
        if not self._pinned:
            self.start = 0
        self._pinned = False
        self._stream = None  # a fresh draw per pass: the base may have changed (e.g. its indices)
        stream = self.stream()
        return iter([stream[p] for p in self.positions()])

    def __len__(self):
        return len(self.positions())

    def __repr__(self):
        return (f"ShardSampler(rank={self.rank}, world_size={self.world_size}, epoch={self.epoch}, "
                f"start={self.start}, base={type(self.base).__name__})")


class StreamShardSampler(Sampler):
    """This rank's share of an endless or very long sampler's stream, read lazily: no data cursor.

    The stream is ``base`` iterated with its generators and the global streams seeded from
    ``(seed, epoch)`` while it sets up (its first position); rank ``r`` of ``W`` takes positions
    ``r, r + W, ...`` as they come, so memory stays bounded and the first batch comes at once. With a
    length, the tail is dealt as :func:`shard_positions` deals it (``batch_size``, ``drop_last``,
    ``lockstep``); without one the stream is taken to be endless (a stream that ends may leave ranks one
    batch apart). It has no ``set_start``/``position_after``: commits inside its epochs are skipped.

    Example:
        >>> import itertools
        >>> class Endless(Sampler):
        ...     def __iter__(self):
        ...         return itertools.count()
        >>> list(itertools.islice(StreamShardSampler(Endless(), rank=1, world_size=3), 4))
        [1, 4, 7, 10]
    """

    def __init__(self, base, rank, world_size, *, seed=0, batch_size=1, drop_last=False, lockstep=False):
        _check_shard_args(0, 0, rank, world_size, batch_size)
        self.base, self.rank, self.world_size, self.seed = base, int(rank), int(world_size), int(seed)
        self.batch_size, self.drop_last, self.lockstep = int(batch_size), bool(drop_last), bool(lockstep)
        self.epoch = 0
        self.set_epoch_calls = 0  # see ShardSampler

    def set_epoch(self, epoch):
        """Seed the next pass from ``epoch``."""
        expect(_cursor_int(epoch), "StreamShardSampler.set_epoch", "an int >= 0", epoch)
        self.epoch = int(epoch)
        self.set_epoch_calls += 1

    def _plan(self):
        total = stream_length(self.base)
        if total is None:
            return None
        return _plan(total, 0, self.rank, self.world_size, self.batch_size, self.drop_last, self.lockstep)

    def __iter__(self):
        with seeded(self.base, self.seed, self.epoch):  # samplers make their generator on the first position
            stream = iter(self.base)
            first = next(stream, _END)
        if first is _END:
            return iter(())
        stream = itertools.chain([first], stream)
        plan = self._plan()
        if plan is None:
            return itertools.islice(stream, self.rank, None, self.world_size)
        return _walk(stream, *plan)

    def __len__(self):
        plan = self._plan()
        if plan is None:
            raise TypeError(f"this shard has no length: its sampler {type(self.base).__name__} has none")
        return len(plan[0]) + (plan[1] is not None)

    def __repr__(self):
        return (f"StreamShardSampler(rank={self.rank}, world_size={self.world_size}, epoch={self.epoch}, "
                f"base={type(self.base).__name__})")


def _walk(stream, positions, pad):
    """Yield the items of ``stream`` at ``positions`` (a range), then the one at ``pad`` (or None); lazily."""
    last = max(positions[-1] if positions else -1, -1 if pad is None else pad)
    padded = _END
    for position, item in enumerate(stream):
        if position == pad:
            padded = item
        if position in positions:
            yield item
        if position >= last:
            break
    if padded is not _END:
        yield padded
