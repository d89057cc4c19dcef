"""Which reported checkpoints a run keeps, and their order by score: pure functions of ``(index, metrics)`` entries.

Part of :mod:`raysgd.train`: the policy behind ``CheckpointConfig(num_to_keep, checkpoint_score_attribute,
checkpoint_score_order)``. It decides and never deletes: the run folder deletes what
:func:`checkpoints_to_delete` names, and ``Result.best_checkpoints`` is :func:`best` of what is left.

The rules are Ray Train's (its checkpoint manager):

- Without a score attribute, checkpoints rank by age: the newest ``num_to_keep`` stay.
- With one, they rank by ``metrics[attribute]`` (a nested key as ``"a/b"``), highest best for ``"max"``, lowest for
  ``"min"``; among equal scores the newer ranks higher. A NaN ranks below every number.
- The latest checkpoint is never deleted, whatever its score: a restart after a failure resumes from it (the
  training state in it is the newest there is), so ``num_to_keep=1`` with a score may leave two folders.
- A score that is not a number (a string, None) is refused with a ``ValueError`` naming the attribute (Ray Train
  refuses it too); call :func:`check_score` before writing the checkpoint, so nothing is written for it.
- A checkpoint whose metrics lack the attribute is logged as an error (naming the keys it has) and ranks with the
  NaNs, below every number, in both orders. (Ray Train 2.58 scores it ``-inf`` before applying the order, so under
  ``"min"`` it ranks best and is never deleted; raysgd treats it as the worst.)

``config`` is a :class:`~raysgd.train.config.CheckpointConfig` (read through its three fields only, so this
module imports nothing of raysgd's).

Example:
    >>> from raysgd.train.config import CheckpointConfig
    >>> entries = [(1, {"acc": 0.5}), (2, {"acc": 0.9}), (3, {"acc": 0.7}), (4, {"acc": 0.1})]
    >>> by_accuracy = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc")
    >>> checkpoints_to_delete(entries, by_accuracy)  # 4 is the latest: kept for restarts
    [1]
    >>> [index for index, _ in best(entries, by_accuracy)]  # worst first, best last
    [3, 2]
    >>> checkpoints_to_delete(entries, CheckpointConfig(num_to_keep=2))  # by age
    [1, 2]
"""
import logging
import math
from typing import SupportsFloat, cast

from raysgd.base.checks import expect, is_int, is_number

logger = logging.getLogger(__name__)

ORDERS = ("max", "min")


def lookup(metrics, key, default=None):
    """``metrics[key]``, or the nested value that ``"a/b/0"`` names (dicts and lists), else ``default``.

    Example:
        >>> lookup({"val": {"acc": [0.1, 0.2]}}, "val/acc/1"), lookup({"a/b": 1}, "a/b"), lookup({}, "x", 0)
        (0.2, 1, 0)
    """
    if key in metrics:
        return metrics[key]
    value = metrics
    for part in key.split("/"):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            return default
    return value


def score(metrics, score_attribute, order="max"):
    """The sort key of one checkpoint's ``metrics``: ``(is a number, signed value)``; ascending is worst first.

    Example:
        >>> score({"loss": 0.2}, "loss", "min") > score({"loss": 0.3}, "loss", "min")
        True
        >>> score({"loss": float("nan")}, "loss") < score({"loss": -1e9}, "loss")
        True
    """
    _check_order(order)
    value = lookup(metrics, score_attribute, _MISSING)
    if value is _MISSING:
        logger.error("The metrics reported with a checkpoint have no %r (CheckpointConfig(checkpoint_score_attribute"
                     "=...)); the checkpoint ranks below every scored one. Its metrics have %s", score_attribute,
                     sorted(metrics))
        return (False, 0.0)
    if not is_number(value):  # real: float() would drop a complex's imaginary part (numpy's complex64 too)
        raise ValueError(f"CheckpointConfig(checkpoint_score_attribute={score_attribute!r}) needs a number in the "
                         f"metrics reported with each checkpoint; got {type(value).__name__} {value!r}")
    value = float(cast(SupportsFloat, value))  # numbers.Real has __float__; typeshed's numbers stub does not say so
    if math.isnan(value):
        return (False, 0.0)
    return (True, value if order == "max" else -value)


_MISSING = object()


def check_score(metrics, score_attribute):
    """Refuse (``ValueError``) a score that is there but is not a number, before its checkpoint is written.

    Example:
        >>> check_score({"acc": "high"}, "acc")
        Traceback (most recent call last):
        ...
        ValueError: CheckpointConfig(checkpoint_score_attribute='acc') needs a number in the metrics reported with each checkpoint; got str 'high'
    """
    if score_attribute is not None:
        value = lookup(metrics, score_attribute, _MISSING)
        if value is not _MISSING:
            score({score_attribute: value}, score_attribute)


def _settings(config):
    """``(num_to_keep, score attribute, order)`` of a ``CheckpointConfig`` (None: keep all, by age)."""
    if config is None:
        return None, None, "max"
    order = getattr(config, "checkpoint_score_order", "max")
    _check_order(order)
    return config.num_to_keep, config.checkpoint_score_attribute, order


def ranked(entries, config=None):
    """``entries`` (``[(index, metrics)]``, oldest first) from worst to best: by age, or by score (ties by age).

    Example:
        >>> from raysgd.train.config import CheckpointConfig
        >>> config = CheckpointConfig(checkpoint_score_attribute="l", checkpoint_score_order="min")
        >>> [i for i, _ in ranked([(1, {"l": 3}), (2, {"l": 1}), (3, {"l": 2})], config)]
        [1, 3, 2]
    """
    _, attribute, order = _settings(config)
    entries = list(entries)
    if attribute is None:
        return entries
    return sorted(entries, key=lambda entry: score(entry[1], attribute, order))  # stable: equal scores by age


def best(entries, config=None):
    """The best ``num_to_keep`` of ``entries`` (all when None), worst first, best last (``Result.best_checkpoints``).

    The latest checkpoint, kept for restarts, is not among them when it scores lower (as in Ray Train).

    Example:
        >>> from raysgd.train.config import CheckpointConfig
        >>> config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="a")
        >>> [i for i, _ in best([(1, {"a": 2}), (2, {"a": 1})], config)]
        [1]
    """
    num_to_keep = _settings(config)[0]
    order_of = ranked(entries, config)
    return order_of if num_to_keep is None else order_of[-num_to_keep:]


def checkpoints_to_delete(entries, config=None):
    """The indices of ``entries`` (``[(index, metrics)]``, oldest first) to delete, in ascending order.

    ``config``: a ``CheckpointConfig`` (None keeps everything). Everything outside :func:`best` goes, except the
    latest entry (the restart point: never deleted).

    Example:
        >>> from raysgd.train.config import CheckpointConfig
        >>> checkpoints_to_delete([(1, {}), (2, {}), (3, {})], CheckpointConfig(num_to_keep=1))
        [1, 2]
        >>> checkpoints_to_delete([(1, {"a": 9}), (2, {"a": 1})],
        ...                       CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="a"))
        []
    """
    entries = list(entries)
    num_to_keep = _settings(config)[0]
    if num_to_keep is None or not entries:
        return []
    expect(is_int(num_to_keep, 1), "num_to_keep", "None or an int >= 1", num_to_keep,
           caller="checkpoints_to_delete")
    kept = {index for index, _ in best(entries, config)}
    latest = entries[-1][0]
    return sorted(index for index, _ in entries if index not in kept and index != latest)


def _check_order(order):
    expect(order in ORDERS, "checkpoint_score_order", "'max' or 'min'", order, caller="CheckpointConfig", call=True)


__all__ = ["best", "check_score", "checkpoints_to_delete", "lookup", "ranked", "score"]
