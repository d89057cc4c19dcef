"""raysgd.train: the function API of the Ray Train guides (``ray.train``), run on raysgd's worker group.

Layer 7, beside :mod:`raysgd.torch.torch_trainer`, over :mod:`raysgd.torch.execution`: a training function runs on
every worker (:mod:`~raysgd.train.function_worker`, a ``TorchWorker`` beside the operator one) on the operator API's
run controller, reports metrics and checkpoints (:mod:`~raysgd.train.session`; ``report()`` is the run's commit
point, :mod:`~raysgd.train.reporting`) to ``storage_path/name``, and a failure restarts the group from the newest
good checkpoint (:mod:`~raysgd.train.commits`, :mod:`~raysgd.train.trainer`). Loaders made by
``raysgd.train.torch.prepare_data_loader`` carry raysgd's data cursor (:mod:`~raysgd.train.prepare`): a restart
inside an epoch trains each sample of it once. Lightning: :mod:`raysgd.train.lightning`.

Ray Train 2.x's other names: the configs (:mod:`~raysgd.train.config`), which checkpoints stay
(:mod:`~raysgd.train.retention`), :class:`Checkpoint` (:mod:`~raysgd.train.checkpoint`), what ``fit()`` returns
(:mod:`~raysgd.train.result`) or raises (:mod:`~raysgd.train.errors`), :class:`UserCallback`
(:mod:`~raysgd.train.callback`), :mod:`raysgd.train.collective` and :func:`get_all_reported_checkpoints`
(:mod:`~raysgd.train.reported`). ``docs/coming-from-ray-train.md`` lists every public name of Ray Train's and what
raysgd does with it.

``python -m raysgd.legacy --train script.py`` runs a Ray Train script unchanged (``ray.train`` -> ``raysgd.train``).

Example:
    >>> import raysgd.train
    >>> raysgd.train.ScalingConfig(num_workers=2).worker_range
    (2, 2)
    >>> raysgd.train.tensorflow
    Traceback (most recent call last):
    ...
    ImportError: raysgd.train.tensorflow is not supported: raysgd.train runs PyTorch (and Lightning) training functions; use Ray Train itself (ray.train.tensorflow) for TensorFlow
"""
from raysgd.train.callback import UserCallback
from raysgd.train.checkpoint import Checkpoint, ReportedCheckpoint
from raysgd.train.config import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from raysgd.train.errors import TrainingFailedError, WorkerGroupError
from raysgd.train.reported import get_all_reported_checkpoints
from raysgd.train.result import Result
from raysgd.train.session import TrainContext, get_checkpoint, get_context, get_dataset_shard, report

#: The dataset name ``get_dataset_shard()`` reads by default (Ray Train's constant).
TRAIN_DATASET_KEY = "train"

#: Ray Train names raysgd.train does not provide, and what to use instead.
UNSUPPORTED = {
    "tensorflow": "raysgd.train runs PyTorch (and Lightning) training functions; use Ray Train itself "
                  "(ray.train.tensorflow) for TensorFlow",
    "xgboost": "raysgd.train runs PyTorch training functions; use Ray Train itself (ray.train.xgboost) for XGBoost",
    "lightgbm": "raysgd.train runs PyTorch training functions; use Ray Train itself (ray.train.lightgbm)",
    "horovod": "raysgd.train forms a torch.distributed process group; use prepare_model (DDP) instead of Horovod",
    "huggingface": "use a transformers Trainer inside the training function with raysgd.train.report, or Ray Train",
    "DataParallelTrainer": "use raysgd.train.torch.TorchTrainer",
    "SyncConfig": "checkpoints go straight to RunConfig(storage_path=...) (a folder or a pyarrow.fs URI)",
    "DataConfig": "datasets are split equally among the workers (streaming_split)",
    "_internal": "Ray Train's internals are not part of raysgd.train: use its public names. Ray Tune imports them, so "
                 "a script that uses Ray Tune cannot run under --train: run it without --train, importing "
                 "raysgd.train where it imports ray.train",
    "BackendConfig": "raysgd.train runs torch.distributed only: its one backend config is raysgd.train.torch.TorchConfig",
    "ControllerError": "raysgd's run controller runs in the driver process: an error of its own is raised as it is",
    "PreemptionError": "raysgd has no preemption error type: a preempted or drained node is a failure the run recovers "
                       "from",
    "PreemptionInfo": "raysgd.train has no preemption notices inside the training function",
    "get_preemption_info": "raysgd.train has no preemption notices inside the training function",
    "CheckpointUploadMode": "report() writes its checkpoint before it returns (one mode)",
    "CheckpointConsistencyMode": "every checkpoint is committed when report() returns: get_all_reported_checkpoints() "
                                 "takes the mode's name ('COMMITTED' or 'VALIDATED') and treats both alike",
    "ReportedCheckpointStatus": "raysgd.train has no checkpoint validation: every reported checkpoint is committed",
    "ValidationConfig": "raysgd.train has no asynchronous validation: validate in the training function and report",
    "ValidationFn": "raysgd.train has no asynchronous validation: validate in the training function and report",
    "ValidationTaskConfig": "raysgd.train has no asynchronous validation: validate in the training function and report",
    "v2": "raysgd.train follows Ray Train's public function API: import from raysgd.train",
}


def __getattr__(name):
    if name in UNSUPPORTED:
        raise ImportError(f"raysgd.train.{name} is not supported: {UNSUPPORTED[name]}")
    raise AttributeError(f"module 'raysgd.train' has no attribute {name!r}")


__all__ = ["TRAIN_DATASET_KEY", "Checkpoint", "CheckpointConfig", "FailureConfig", "LoggingConfig", "ReportedCheckpoint", "Result", "RunConfig",
           "ScalingConfig", "TrainContext", "TrainingFailedError", "UserCallback", "WorkerGroupError",
           "get_all_reported_checkpoints", "get_checkpoint", "get_context", "get_dataset_shard", "report"]
