"""Ray metrics: a trainer's speed, failures, resizes and size as ``ray.util.metrics``, for Ray's dashboard and
Prometheus.

Layer 6 (the edge): Ray only. ``TorchTrainer(ray_metrics=True)`` (the default) adds a :class:`RayMetrics` callback
that records, on the driver, tagged ``run=<name>``:

==================================  =======  =========================================================
metric (Prometheus adds ``ray_``)    kind     value
==================================  =======  =========================================================
``raysgd_steps_per_s``              gauge    the last ``train()`` call's steps per worker / its seconds
``raysgd_samples_per_s``            gauge    the last ``train()`` call's samples (all workers) / its seconds
``raysgd_workers``                  gauge    the worker group's size now
``raysgd_failures``                 counter  worker failures met (``_total`` in Prometheus)
``raysgd_resizes``                  counter  changes of the group's size
``raysgd_checkpoints``              counter  durable checkpoints written (``storage_path``)
``raysgd_commit_latency_s``         gauge    the latest commit's seconds from its start until the store
                                             held every rank's record (the slowest rank's, measured on
                                             the workers), of the last ``train()`` call that stored one
``raysgd_checkpoint_upload_s``      gauge    the latest durable checkpoint's write time (state and
                                             marker, measured on the checkpoint writer's thread)
``raysgd_holder_replacements``      counter  commit part holders that lost their process and were
                                             replaced (``TorchTrainer.holder_replacements``), counted
                                             at each ``train()`` result
==================================  =======  =========================================================

Ray exports them from the node's metrics agent (``ray.nodes()[i]["MetricsExportPort"]``, every few seconds), which
runs with Ray's default install (``pip install "raysgd[metrics]"`` brings ``ray[default]``, and so does the ``test``
extra); with a minimal Ray they are recorded and not exported (its node agent runs ``--minimal``, without them).

Example:
    >>> metrics = RayMetrics(run="digits")  # doctest: +SKIP
    >>> trainer = TorchTrainer(training_operator_cls=MyOperator, callbacks=[metrics], ray_metrics=False)  # doctest: +SKIP
    >>> rate(120, 2.0), rate(5, 0)
    (60.0, None)
"""
import itertools
import logging
import os

from ray.util import metrics

from raysgd.callbacks import Callback

logger = logging.getLogger(__name__)

_runs = itertools.count(1)


def rate(amount, seconds):
    """``amount / seconds``, or None when either is missing or ``seconds`` is not positive."""
    if amount is None or not seconds or seconds <= 0:
        return None
    return amount / seconds


class RayMetrics(Callback):
    """Records the run's metrics with ``ray.util.metrics`` (see the module docstring).

    Args:
        run: the ``run`` tag (default: ``"<driver pid>-<n>"``, the n-th trainer of this driver).

    Example:
        >>> RayMetrics(run="exp1").run  # doctest: +SKIP
        'exp1'
    """

    def __init__(self, run=None):
        self.run = str(run) if run is not None else f"{os.getpid()}-{next(_runs)}"
        self._tags = {"run": self.run}
        keys = ("run",)
        self.steps_per_s = metrics.Gauge("raysgd_steps_per_s", "train() steps per worker per second (last call)",
                                         tag_keys=keys)
        self.samples_per_s = metrics.Gauge("raysgd_samples_per_s", "train() samples per second (last call)",
                                           tag_keys=keys)
        self.workers = metrics.Gauge("raysgd_workers", "workers in the group now", tag_keys=keys)
        self.failures = metrics.Counter("raysgd_failures", "worker failures met", tag_keys=keys)
        self.resizes = metrics.Counter("raysgd_resizes", "changes of the worker group's size", tag_keys=keys)
        self.checkpoints = metrics.Counter("raysgd_checkpoints", "durable checkpoints written", tag_keys=keys)
        self.commit_latency_s = metrics.Gauge("raysgd_commit_latency_s", "the latest commit's seconds until the store "
                                              "held every rank's record (last train() call)", tag_keys=keys)
        self.checkpoint_upload_s = metrics.Gauge("raysgd_checkpoint_upload_s", "the latest durable checkpoint's "
                                                 "write time in seconds", tag_keys=keys)
        self.holder_replacements = metrics.Counter("raysgd_holder_replacements", "commit part holders that lost "
                                                   "their process and were replaced", tag_keys=keys)
        self._replacements_seen = 0

    def on_train_result(self, trainer, result):
        seconds = getattr(trainer, "last_call_s", None)
        steps, samples = rate(result.get("batch_count"), seconds), rate(result.get("num_samples"), seconds)
        if steps is not None:
            self.steps_per_s.set(steps, tags=self._tags)
        if samples is not None:
            self.samples_per_s.set(samples, tags=self._tags)
        self.workers.set(trainer.worker_group.num_workers, tags=self._tags)
        latency = getattr(trainer, "last_commit_latency_s", None)
        if latency is not None:
            self.commit_latency_s.set(latency, tags=self._tags)
        replaced = getattr(trainer, "holder_replacements", 0) or 0
        if replaced > self._replacements_seen:
            self.holder_replacements.inc(replaced - self._replacements_seen, tags=self._tags)
            self._replacements_seen = replaced

    def on_failure(self, trainer, failure):
        self.failures.inc(1, tags=self._tags)

    def on_resize(self, trainer, old, new):
        self.resizes.inc(1, tags=self._tags)
        self.workers.set(new, tags=self._tags)

    def on_checkpoint(self, trainer, path):
        self.checkpoints.inc(1, tags=self._tags)
        seconds = getattr(trainer, "last_checkpoint_s", None)
        if seconds is not None:
            self.checkpoint_upload_s.set(seconds, tags=self._tags)
