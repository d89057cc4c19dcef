"""``get_all_reported_checkpoints()``: inside a training function, every checkpoint the run keeps, with its metrics.

Part of :mod:`raysgd.train` (Ray Train's ``ray.train.get_all_reported_checkpoints``). Every rank calls it (it waits
for the others, as a :func:`~raysgd.train.collective.barrier`: each earlier ``report()`` is then complete on every
rank), then lists the run's complete checkpoints, oldest first, with the metrics reported with each: those the
attempt started with (read by the driver from the run folder, as it was when the attempt began) and those reported
since. Every reported checkpoint is committed when ``report()`` returns (raysgd has no asynchronous validation), so
both of Ray Train's consistency modes mean the same here.

Example:
    >>> def train_func():  # doctest: +SKIP
    ...     ...  # train, raysgd.train.report(metrics, checkpoint=...) each epoch
    ...     for reported in raysgd.train.get_all_reported_checkpoints():
    ...         print(reported.checkpoint.path, reported.metrics["loss"])
    >>> get_all_reported_checkpoints()
    Traceback (most recent call last):
    ...
    RuntimeError: raysgd.train.get_all_reported_checkpoints() works only inside the training function that TorchTrainer runs on its workers
"""
from __future__ import annotations

from raysgd.base.checks import expect, is_number, plain_json
from raysgd.train import collective, retention
from raysgd.train import session as _session
from raysgd.train.checkpoint import Checkpoint, ReportedCheckpoint

#: Ray Train's consistency modes (``ray.train.CheckpointConsistencyMode``), by name.
CONSISTENCY_MODES = ("COMMITTED", "VALIDATED")


def get_all_reported_checkpoints(consistency_mode: object = "VALIDATED",
                                 timeout_s: float | None = None) -> list[ReportedCheckpoint]:
    """``[ReportedCheckpoint(checkpoint, metrics)]`` of the checkpoints the run keeps, oldest first: those
    ``CheckpointConfig(num_to_keep)`` deletes are left out, as in Ray Train.

    Args:
        consistency_mode: ``"COMMITTED"`` or ``"VALIDATED"`` (or Ray's enum of them): the same here.
        timeout_s: None or seconds > 0, checked for Ray Train's signature; the wait (for the other ranks) is
            bounded by the process group's timeout, ``TorchConfig(timeout_s)``.
    """
    mode = getattr(consistency_mode, "value", consistency_mode)
    how = {"caller": "get_all_reported_checkpoints", "call": True}
    expect(mode in CONSISTENCY_MODES, "consistency_mode", "'COMMITTED' or 'VALIDATED'", consistency_mode, **how)
    expect(timeout_s is None or is_number(timeout_s, above=0), "timeout_s", "None or seconds > 0", timeout_s, **how)
    session = _session.current("get_all_reported_checkpoints()")
    collective.barrier()
    if session.reporter is None:
        return []
    reported, config = session.reporter.reported, session.reporter.plan.checkpoint_config
    deleted = set(retention.checkpoints_to_delete([(index, plain_json(metrics)) for index, (_, metrics)
                                                   in enumerate(reported)], config))
    return [ReportedCheckpoint(Checkpoint(uri), metrics) for index, (uri, metrics) in enumerate(reported)
            if index not in deleted]


__all__ = ["get_all_reported_checkpoints"]
