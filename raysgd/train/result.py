"""What ``TorchTrainer.fit()`` returns: :class:`Result` (metrics, checkpoints, error), built from a run's checkpoints.

Part of :mod:`raysgd.train`. A Result holds the last metrics, the latest checkpoint, the best ones
(``best_checkpoints``: ordered by ``CheckpointConfig``'s score when it has one, see :mod:`raysgd.train.retention`),
the error that ended the run and rank 0's return value. :meth:`Result.from_path` reads a finished (or interrupted)
run's folder back; :meth:`Result.from_checkpoints` is how the trainer builds one. ``path`` and ``filesystem`` are
Ray Train's: the run folder's path inside its ``pyarrow.fs`` filesystem (``bucket/runs/exp`` for
``s3://bucket/runs/exp``). Metrics are returned as reported: no key is added.

Example:
    >>> from raysgd.train.checkpoint import Checkpoint
    >>> checkpoints = [(Checkpoint("/tmp/r/exp/checkpoint_000001"), {"loss": 0.4}),
    ...                (Checkpoint("/tmp/r/exp/checkpoint_000002"), {"loss": 0.2})]
    >>> result = Result.from_checkpoints(checkpoints, path="/tmp/r/exp")
    >>> result
    Result(
      metrics={'loss': 0.2},
      path='/tmp/r/exp',
      filesystem='local',
      checkpoint=Checkpoint(filesystem=local, path=/tmp/r/exp/checkpoint_000002)
    )
    >>> result.get_best_checkpoint("loss", "min").path
    '/tmp/r/exp/checkpoint_000002'
"""
from __future__ import annotations

import dataclasses
import os

from raysgd import optional
from raysgd.base.checks import expect, is_path
from raysgd.base.paths import is_uri, local_path
from raysgd.torch.storage import filesystem as _fs
from raysgd.train import retention
from raysgd.train.checkpoint import Checkpoint
from raysgd.train.commits import complete_checkpoints
from raysgd.train.config import CheckpointConfig
from typing import Any, Iterable

#: Metric keys Ray Train's ``repr(Result)`` leaves out (Ray Tune's automatic keys); ``Result.metrics`` keeps them.
REPR_HIDDEN_KEYS = frozenset({
    "training_iteration", "time_total_s", "episodes_total", "timesteps_total", "node_ip", "hostname", "pid",
    "time_this_iter_s", "timestamp", "date", "time_since_restore", "timesteps_since_restore",
    "iterations_since_restore", "config", "checkpoint_dir_name", "done", "trial_id", "experiment_tag",
    "should_checkpoint", "_report_on"})


@dataclasses.dataclass(repr=False)
class Result:
    """What ``TorchTrainer.fit()`` returns.

    Attributes:
        metrics: the last metrics rank 0 reported, exactly as reported.
        checkpoint: the latest reported :class:`~raysgd.train.Checkpoint` (None if none was reported).
        path: the run folder (``storage_path/name``), as a path inside :attr:`filesystem`.
        error: the exception that ended the run, or None.
        best_checkpoints: ``[(Checkpoint, metrics)]`` of the best checkpoints kept, worst first, best last: by
            ``CheckpointConfig(checkpoint_score_attribute)`` when set, else by age (oldest first).
        num_failures: failures recovered from (raysgd's addition).
        return_value: what the training function returned on rank 0 (None when it failed).
        metrics_dataframe: a pandas DataFrame of ``best_checkpoints``' metrics, one row each (needs pandas).

    Example:
        >>> Result(metrics={"loss": 0.1}, checkpoint=None, path="/tmp/r/exp").metrics["loss"]
        0.1
    """

    metrics: dict | None
    checkpoint: Checkpoint | None
    path: str | None
    error: BaseException | None = None
    best_checkpoints: list = dataclasses.field(default_factory=list)
    num_failures: int = 0
    return_value: object = None
    _storage_filesystem: object = None

    def __post_init__(self):
        text = os.fspath(self.path) if self.path is not None else None
        if text is not None and self._storage_filesystem is None and is_uri(text):
            self._storage_filesystem, text = _fs.resolve(text)  # Ray Train's path: inside the filesystem
        self.path = text

    @property
    def filesystem(self) -> Any:
        """The ``pyarrow.fs`` filesystem holding :attr:`path` (the local one unless the run was stored remotely)."""
        if self._storage_filesystem is None:
            self._storage_filesystem = _fs.resolve(self.path or os.sep)[0]
        return self._storage_filesystem

    @property
    def metrics_dataframe(self) -> Any:
        """A pandas DataFrame of the metrics of :attr:`best_checkpoints`, one row per checkpoint in their order;
        None when there is none. Needs pandas (``pip install "raysgd[data]"``)."""
        if not self.best_checkpoints:
            return None
        pandas = optional.require("pandas", "Result.metrics_dataframe", extra="data")
        return pandas.DataFrame([metrics for _, metrics in self.best_checkpoints])

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint:
        """The checkpoint of :attr:`best_checkpoints` with the highest (``mode="max"``) or lowest (``"min"``)
        ``metric`` (a nested one as ``"a/b"``); checkpoints without it are left out.

        Example:
            >>> Result({}, None, "/tmp/r").get_best_checkpoint("loss", "min")
            Traceback (most recent call last):
            ...
            RuntimeError: Result.get_best_checkpoint: the run kept no checkpoint (none was reported)
        """
        expect(isinstance(metric, str), "metric", "a metric's name (str; 'a/b' for a nested one)", metric, TypeError,
               "Result.get_best_checkpoint", call=True, typed=True)
        expect(mode in retention.ORDERS, "mode", "'max' or 'min'", mode, caller="Result.get_best_checkpoint",
               call=True)
        if not self.best_checkpoints:
            raise RuntimeError("Result.get_best_checkpoint: the run kept no checkpoint (none was reported)")
        missing = object()
        scored = [(checkpoint, retention.lookup(metrics, metric, missing)) for checkpoint, metrics in
                  self.best_checkpoints]
        scored = [(checkpoint, value) for checkpoint, value in scored if value is not missing and value is not None]
        if not scored:
            known = sorted({key for _, metrics in self.best_checkpoints for key in metrics})
            raise RuntimeError(f"Result.get_best_checkpoint(metric={metric!r}): no kept checkpoint was reported "
                               f"with that metric; they have {known}")
        return (max if mode == "max" else min)(scored, key=lambda pair: pair[1])[0]

    @classmethod
    def from_checkpoints(cls, checkpoints: Iterable[tuple[Checkpoint, dict]], *, path: str | None,
                         checkpoint_config: CheckpointConfig | None = None, metrics: dict | None = None,
                         error: BaseException | None = None, return_value: object = None, num_failures: int = 0,
                         storage_filesystem: object = None) -> Result:
        """A Result of a run whose kept checkpoints are ``checkpoints`` (``[(Checkpoint, metrics)]``, oldest first).

        ``metrics`` defaults to the latest checkpoint's; ``best_checkpoints`` are ranked by ``checkpoint_config``
        (a :class:`~raysgd.train.CheckpointConfig`; None: by age) and cut to its ``num_to_keep``.

        Example:
            >>> from raysgd.train.config import CheckpointConfig
            >>> kept = [(Checkpoint("/r/c1"), {"acc": 0.9}), (Checkpoint("/r/c2"), {"acc": 0.5})]
            >>> result = Result.from_checkpoints(kept, path="/r", checkpoint_config=CheckpointConfig(
            ...     num_to_keep=1, checkpoint_score_attribute="acc"))
            >>> result.checkpoint.path, [c.path for c, _ in result.best_checkpoints]
            ('/r/c2', ['/r/c1'])
        """
        _check_config(checkpoint_config, "Result.from_checkpoints")
        checkpoints = list(checkpoints)
        indexed = [(index, metrics_of) for index, (_, metrics_of) in enumerate(checkpoints)]
        best = [checkpoints[index] for index, _ in retention.best(indexed, checkpoint_config)]
        latest = checkpoints[-1] if checkpoints else (None, None)
        return cls(metrics=latest[1] if metrics is None else metrics, checkpoint=latest[0], path=path, error=error,
                   best_checkpoints=best, num_failures=num_failures, return_value=return_value,
                   _storage_filesystem=storage_filesystem)

    @classmethod
    def from_path(cls, path: str | os.PathLike, storage_filesystem: object = None,
                  checkpoint_config: CheckpointConfig | None = None) -> Result:
        """The Result of the run folder ``path`` (``storage_path/name``, local or a URI): its complete checkpoints,
        the latest one's metrics. ``best_checkpoints`` are ordered by ``checkpoint_config`` (raysgd's addition;
        default: by age). The run's error, if any, is not stored: ``error`` is None.

        Example:
            >>> Result.from_path("/no/such/run")
            Traceback (most recent call last):
            ...
            RuntimeError: Result.from_path: the run folder /no/such/run does not exist
        """
        if storage_filesystem is not None:
            raise NotImplementedError("Result.from_path(storage_filesystem=...) is not supported by raysgd.train: "
                                      "pass the run folder as a URI (s3://bucket/path?endpoint_override=...)")
        expect(is_path(path), "path", "a run folder's path or URI", path, TypeError, "Result.from_path", call=True,
               typed=True)
        _check_config(checkpoint_config, "Result.from_path")
        text = os.fspath(path)
        local = local_path(text)  # "~/runs/exp" or a relative path: read as the run's storage wrote it
        base, query = (local, "") if local is not None else (text.split("?", 1) + [""])[:2]
        base = base.rstrip("/")
        filesystem, fs_path = _fs.resolve(base + ("?" + query if query else ""))
        if filesystem.get_file_info(fs_path).type != _fs.pafs.FileType.Directory:
            raise RuntimeError(f"Result.from_path: the run folder {base} does not exist")
        storage = _fs.CheckpointStorage(base + ("?" + query if query else ""), None, marker=_fs.REPORT_MARKER)
        complete = complete_checkpoints(storage)
        if not complete:
            raise RuntimeError(f"Result.from_path: {base} holds no complete checkpoint (checkpoint_NNNNNN/ with its "
                               f"marker): the run reported none, or the folder is not a raysgd.train run folder")
        checkpoints = [(Checkpoint(uri), marker.get("metrics", {})) for uri, marker in complete]
        return cls.from_checkpoints(checkpoints, path=fs_path, checkpoint_config=checkpoint_config,
                                    storage_filesystem=filesystem)

    def __repr__(self):
        shown: dict[str, Any] = {}
        if self.error is not None:
            shown["error"] = type(self.error).__name__
        shown["metrics"] = {key: value for key, value in self.metrics.items() if key not in REPR_HIDDEN_KEYS} \
            if self.metrics else self.metrics
        shown["path"] = self.path
        shown["filesystem"] = "local" if self._storage_filesystem is None else self.filesystem.type_name
        shown["checkpoint"] = self.checkpoint
        lines = ",\n".join(f"  {key}={value!r}" for key, value in shown.items())
        return f"{type(self).__name__}(\n{lines}\n)"


def _check_config(checkpoint_config, caller):
    expect(checkpoint_config is None or isinstance(checkpoint_config, CheckpointConfig), "checkpoint_config",
           "None or a raysgd.train.CheckpointConfig", checkpoint_config, TypeError, caller, call=True, typed=True)


__all__ = ["Result"]
