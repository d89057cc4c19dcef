"""The iterators of one worker's epochs: the train or validation iterator kept across calls, and one call's batches.

Layer 1: the standard library only. ``train(num_steps=k)`` stops mid-epoch and the next call goes on from there, so
the iterator outlives the call (:class:`PersistentIterator`); a call's loop may end the epoch early
(:class:`CallBatches`, Lightning's ``on_train_batch_start`` returning ``-1``).

Example:
    >>> epochs = []
    >>> batches = PersistentIterator(lambda: [1, 2, 3], on_new_epoch=epochs.append)
    >>> list(batches.take(2)), list(batches.take(2)), len(epochs)
    ([1, 2], [3, 1], 2)
    >>> batches.mid_epoch
    True
"""
import contextlib


class PersistentIterator:
    """The train or validation iterator kept across calls, so ``num_steps`` can stop and resume mid-epoch.

    A new underlying iterator (a new epoch) is created lazily on the first pull after the previous
    one ran out; ``on_new_epoch`` is called just before.
    """

    def __init__(self, get_loader, on_new_epoch, after_iter=None, on_abandon=None, resuming=None):
        self._get_loader = get_loader
        self._on_new_epoch = on_new_epoch
        self._after_iter = after_iter or (lambda: None)
        self._on_abandon = on_abandon
        self._resuming = resuming or (lambda: False)  # the next epoch starts at a loaded cursor
        self._iterator = None

    def reset(self):
        self._iterator = None

    @contextlib.contextmanager
    def fresh_after_error(self):
        """On any error inside, drop the half-read iterator (``on_abandon`` runs): the next pull starts afresh."""
        try:
            yield
        except BaseException:
            if self._iterator is not None and self._on_abandon is not None:
                self._on_abandon()
            self._iterator = None
            raise

    @property
    def mid_epoch(self):
        return self._iterator is not None

    def _current(self):
        if self._iterator is None:
            loader = self._get_loader()
            self._on_new_epoch(loader)
            self._iterator = iter(loader)
            self._after_iter()
        return self._iterator

    def take(self, num_steps=None):
        """Yield the rest of the current epoch (``None``) or exactly ``num_steps`` batches, wrapping epochs."""
        if num_steps is None:
            yield from self._current()
            self._iterator = None
            return
        taken = 0
        while taken < num_steps:
            fresh = self._iterator is None
            resumed = fresh and self._resuming()  # a cursor at the epoch's end resumes an empty rest
            iterator = self._current()
            yielded = 0
            for batch in iterator:
                yielded += 1
                taken += 1
                yield batch
                if taken >= num_steps:
                    return
            self._iterator = None
            if fresh and yielded == 0 and not resumed:
                return  # an empty loader: stop instead of looping forever


class CallBatches:
    """The batches of one ``train()`` call as the operator's loop sees them; ``end_epoch()`` drops the rest of the
    epoch once the call ends (Lightning's ``on_train_batch_start`` returning ``-1``)."""

    def __init__(self, batches):
        self._batches, self.ended = batches, False

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._batches)

    def end_epoch(self):
        self.ended = True

    def close(self):
        self._batches.close()
