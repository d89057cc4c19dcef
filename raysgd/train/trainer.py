"""Ray Train's ``TorchTrainer``: runs a training function on a raysgd worker group, with recovery and resume.

Part of :mod:`raysgd.train` (layer 6: over :mod:`raysgd.torch.execution`). ``fit()`` starts the workers with
raysgd's :class:`~raysgd.torch.execution.worker_group.WorkerGroup` (placement group, gloo or NCCL process group,
failure detection under deadlines) whose workers are :class:`~raysgd.train.function_worker.FunctionWorker`, and runs
``train_loop_per_worker`` on every rank. A worker failure (a dead actor, a lost peer) tears the group down and,
while ``FailureConfig(max_failures)`` allows, starts it again (as many as fit for a ``(min, max)`` range) and runs
the function again: ``get_checkpoint()`` then returns the latest reported checkpoint. A new ``fit()`` (or the
script run again) with the same ``RunConfig(name, storage_path)`` starts from that checkpoint too.

Example:
    >>> TorchTrainer(lambda: None, scaling_config={"num_workers": 2})
    Traceback (most recent call last):
    ...
    TypeError: TorchTrainer(scaling_config=...) expects a raysgd.train.ScalingConfig (ScalingConfig(num_workers=2)); got dict {'num_workers': 2}
"""
import logging
import time

import ray

from raysgd.torch import constants
from raysgd.torch.errors import WorkerFailure
from raysgd.torch.execution import restarts
from raysgd.torch.execution.worker_group import WorkerGroup
from raysgd.train.checkpoint import Checkpoint
from raysgd.train.result import Result
from raysgd.train.config import RunConfig, ScalingConfig, TorchConfig
from raysgd.train.errors import TrainingFailedError
from raysgd.train.function_worker import FunctionWorker
from raysgd.train.run_storage import RunFolder

logger = logging.getLogger(__name__)


def _check(ok, name, expected, value):
    if not ok:
        raise TypeError(f"TorchTrainer({name}=...) expects {expected}; got {type(value).__name__} {value!r}")


class TorchTrainer:
    """Runs ``train_loop_per_worker`` on ``scaling_config.num_workers`` workers (see the module docstring).

    Args:
        train_loop_per_worker: ``fn(config)`` or ``fn()``, run on every worker.
        train_loop_config: the dict passed to it.
        scaling_config: :class:`~raysgd.train.config.ScalingConfig`.
        run_config: :class:`~raysgd.train.config.RunConfig` (``name``, ``storage_path``, ``failure_config``).
        datasets: ``{name: ray.data.Dataset}``, split among the workers (``get_dataset_shard(name)``).
        torch_config: :class:`~raysgd.train.config.TorchConfig` (backend, process-group timeout).
        resume_from_checkpoint: a :class:`Checkpoint` to start from when the run folder has none yet.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     raysgd.train.report({"loss": 0.0})
        >>> result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2)).fit()  # doctest: +SKIP
    """

    def __init__(self, train_loop_per_worker, *, train_loop_config=None, scaling_config=None, run_config=None,
                 datasets=None, torch_config=None, resume_from_checkpoint=None, dataset_config=None, metadata=None):
        _check(callable(train_loop_per_worker), "train_loop_per_worker", "a function fn(config) or fn()",
               train_loop_per_worker)
        _check(train_loop_config is None or isinstance(train_loop_config, dict), "train_loop_config",
               "None or a dict", train_loop_config)
        _check(scaling_config is None or isinstance(scaling_config, ScalingConfig), "scaling_config",
               "a raysgd.train.ScalingConfig (ScalingConfig(num_workers=2))", scaling_config)
        _check(run_config is None or isinstance(run_config, RunConfig), "run_config",
               "a raysgd.train.RunConfig (RunConfig(name=..., storage_path=...))", run_config)
        _check(datasets is None or (isinstance(datasets, dict) and all(
            isinstance(k, str) and hasattr(v, "streaming_split") for k, v in datasets.items())), "datasets",
            "None or a dict {name: ray.data.Dataset}", datasets)
        _check(torch_config is None or isinstance(torch_config, TorchConfig), "torch_config",
               "None or a raysgd.train.torch.TorchConfig", torch_config)
        _check(resume_from_checkpoint is None or isinstance(resume_from_checkpoint, Checkpoint),
               "resume_from_checkpoint", "None or a raysgd.train.Checkpoint", resume_from_checkpoint)
        if dataset_config is not None:
            raise NotImplementedError("TorchTrainer(dataset_config=...) is not supported by raysgd.train: every "
                                      "dataset is split equally among the workers (streaming_split)")
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config or {})
        self.scaling_config = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.torch_config = torch_config or TorchConfig()
        self.datasets = dict(datasets or {})
        self.resume_from_checkpoint = resume_from_checkpoint
        self.metadata = metadata

    def _group(self):
        scaling, torch_config = self.scaling_config, self.torch_config
        backend = torch_config.backend or ("nccl" if scaling.use_gpu else "gloo")
        return WorkerGroup({"use_gpu": scaling.use_gpu, "backend": backend},
                           num_cpus_per_worker=scaling.num_cpus_per_worker, num_gpus=scaling.num_gpus_per_worker,
                           timeout_s=torch_config.timeout_s, placement_strategy=scaling.placement_strategy,
                           worker_cls=FunctionWorker)

    def _start(self, group):
        low, high = self.scaling_config.worker_range
        return restarts.start_first_group(
            lambda n: group.start(n, self.train_loop_per_worker, self.train_loop_config), group.how_many_fit, low,
            high, self.scaling_config.is_range, constants.SGD_PLACEMENT_GROUP_TIMEOUT_S)

    def _resume_point(self, folder):
        latest = folder.latest()
        if latest is None and self.resume_from_checkpoint is not None:
            return self.resume_from_checkpoint.uri, {}
        return latest

    def _reform(self, group):
        """After a failure: re-form the group from its survivors (they keep their processes, only the lost ranks
        start anew: :meth:`WorkerGroup.reform`); returns the size, or None after tearing it down (start again)."""
        try:
            size = group.reform(self.train_loop_per_worker, lambda n: self.train_loop_config,
                                self.scaling_config.worker_range[0])
        except Exception as err:  # noqa: BLE001 (starting every worker again is the tried path)
            logger.warning("Re-forming the group from its survivors failed (%s: %s); restarting every worker",
                           type(err).__name__, err)
            size = None
        if size is None:
            group.shutdown(force=True)
        return size

    def _attempt(self, group, folder, size):
        """Run the function on every rank of the started group; returns rank 0's answer."""
        ips = group.run("node_ip", deadline_s=self.torch_config.timeout_s + 60)
        nodes = list(dict.fromkeys(ips))
        if self.datasets and ray.cluster_resources().get("CPU", 0) <= size * self.scaling_config.num_cpus_per_worker:
            logger.warning("TorchTrainer(datasets=...): the workers hold every CPU of the cluster, and Ray Data's "
                           "read tasks need CPUs of their own: reading will wait until some are free")
        shards = {name: dataset.streaming_split(size, equal=True) for name, dataset in self.datasets.items()}
        run_info = {"storage_path": self.run_config.storage_path, "name": self.run_config.name,
                    "num_to_keep": self.run_config.checkpoint_config.num_to_keep}
        resume = self._resume_point(folder)
        if resume is not None:
            logger.info("Starting the training function from %s", resume[0])

        def per_rank(n):
            return [{"local_world_size": ips.count(ips[rank]), "node_rank": nodes.index(ips[rank]),
                     "dataset_shards": {name: split[rank] for name, split in shards.items()}} for rank in range(n)]

        return group.run("run_loop", run_info, resume, rank_kwargs=per_rank)[0]

    def fit(self):
        """Run the training function on the workers until it returns; returns a
        :class:`~raysgd.train.checkpoint.Result`. Raises :class:`TrainingFailedError` (its ``result`` attached) when
        the function raised or the workers failed more than ``max_failures`` times."""
        folder = RunFolder(self.run_config.storage_path, self.run_config.name)
        folder.check_writable()
        if not ray.is_initialized():
            ray.init()  # as Ray Train does: a local cluster, or RAY_ADDRESS's
        max_failures = self.run_config.failure_config.max_failures
        group, failures, answer, error, size = self._group(), 0, None, None, None
        try:
            while True:
                try:
                    size = size or self._start(group)
                    answer = self._attempt(group, folder, size)
                    break
                except WorkerFailure as failure:
                    failures += 1
                    if max_failures != -1 and failures > max_failures:
                        error = failure
                        break
                    logger.warning("Worker failure %d (of at most %s): restarting the workers from the latest "
                                   "reported checkpoint (%s)", failures, "any" if max_failures == -1 else max_failures,
                                   failure)
                    time.sleep(min(constants.SGD_BACKOFF_CAP_S, 0.2 * failures))
                    size = self._reform(group)
                except Exception as err:  # noqa: BLE001 (the training function's own error: not retried)
                    error = err
                    break
        finally:
            group.shutdown(force=error is not None)
        result = self._result(folder, answer, error, failures)
        if error is not None:
            kind = "the workers failed" if isinstance(error, WorkerFailure) else "the training function raised"
            raise TrainingFailedError(f"Training failed: {kind} ({type(error).__name__}: {error}); the latest "
                                      f"checkpoint is in {folder.path}", result) from error
        return result

    def _result(self, folder, answer, error, failures):
        kept = [(Checkpoint(uri), marker.get("metrics", {})) for uri, marker in folder.complete()]
        metrics = (answer or {}).get("metrics")
        if metrics is None and kept:
            metrics = kept[-1][1]
        checkpoint = kept[-1][0] if kept else None
        return Result(metrics=metrics or {}, checkpoint=checkpoint, path=folder.path, error=error,
                      best_checkpoints=kept, num_failures=failures)
