"""RaySGD 1.x's ``ray.util.sgd.torch.worker_group``: the worker pool, and the default scale-up cooldown.

Package glue (1.x's path): 1.x's ``RemoteWorkerGroup``/``LocalWorkerGroup``/``DeactivatedWorkerGroup`` are one
:class:`~raysgd.torch.execution.worker_group.WorkerGroup` now (see :mod:`raysgd.torch.execution`), and
``RESIZE_COOLDOWN_S`` is the default cooldown before the pool grows back (``SGD_RESIZE_COOLDOWN_S`` changes it).

Example:
    >>> RESIZE_COOLDOWN_S >= 0
    True
"""
from raysgd.torch.constants import RESIZE_COOLDOWN_S
from raysgd.torch.execution.worker_group import WorkerGroup

__all__ = ["RESIZE_COOLDOWN_S", "WorkerGroup"]
