"""``ray.train.utils`` under ``python -m raysgd.legacy --train``: the one name Ray Data asks Ray Train for.

Part of :mod:`raysgd.train`. Ray Data's ``DataIterator.iter_torch_batches`` imports
``ray.train.utils._in_ray_train_worker`` to pick the device of ``device="auto"`` (the worker's, inside a training
function; else the CPU). With ``ray.train`` mapped to :mod:`raysgd.train`, that import finds this module, whose
answer is whether a raysgd.train training function is running in this process.

Example:
    >>> _in_ray_train_worker()  # not inside TorchTrainer's training function
    False
"""
from raysgd.train import session as _session


def _in_ray_train_worker():
    """Whether this process is running a raysgd.train training function (Ray Data's question, by Ray Train's name).

    Example:
        >>> _in_ray_train_worker()
        False
    """
    return _session.is_running()
