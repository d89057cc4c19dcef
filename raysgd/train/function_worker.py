"""The function worker: a :class:`~raysgd.torch.execution.worker.TorchWorker` that runs a Ray Train training function.

Part of :mod:`raysgd.train`. The worker group starts it as it starts a ``TorchWorker`` (the same placement,
rendezvous and gloo/NCCL process group, the same failure detection): only the work differs. Instead of an
operator, :meth:`FunctionWorker.setup_operator` picks the device, and :meth:`FunctionWorker.run_loop` runs
``train_loop_per_worker(config)`` inside a :class:`~raysgd.train.session.Session`. A torch.distributed timeout or
lost peer becomes :class:`~raysgd.torch.errors.CollectiveError` (a worker failure, retried); any other exception
is the user's (re-raised by ``fit``).

Example:
    >>> import torch
    >>> def loop(config):
    ...     return None
    >>> worker = FunctionWorker(loop, {"lr": 0.1}, is_local=True)
    >>> worker.setup_operator()
    >>> worker.device
    device(type='cpu')
"""
import inspect
import logging
import os

import torch

from raysgd.torch.execution.worker import TorchWorker, guard_collectives
from raysgd.train import session as _session

logger = logging.getLogger(__name__)


class FunctionWorker(TorchWorker):
    """One rank running a training function (see the module docstring); ``operator_cls`` is the function."""

    def __init__(self, train_fn, config, **options):
        super().__init__(train_fn, config, **options)
        self.train_fn = train_fn
        self.device, self.local_rank = torch.device("cpu"), 0

    def setup_operator(self, local_rank=0):
        """No operator: remember the local rank and pick the device."""
        self.local_rank = local_rank
        self.device = torch.device("cpu")
        if self.use_gpu and torch.cuda.is_available():
            index = 0 if not self._is_local else torch.cuda.current_device()
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)

    def run_loop(self, run_info, resume=None, local_world_size=1, node_rank=0, dataset_shards=None):
        """Run the training function once; returns ``{"metrics", "checkpoint", "reports"}`` of this rank.

        ``run_info``: ``{"storage_path", "name", "num_to_keep"}``; ``resume``: ``(uri, marker)`` of the
        checkpoint to start from, or None."""
        folder = _session.open_run_folder(run_info["storage_path"], run_info["name"])
        context = _session.TrainContext(self.world_size, self.world_rank, self.local_rank, local_world_size,
                                        node_rank, run_info["name"], run_info["storage_path"])
        session = _session.Session(context, self.device, folder, resume=resume, dataset_shards=dataset_shards,
                                   num_to_keep=run_info.get("num_to_keep"))
        os.environ.update({"RANK": str(self.world_rank), "WORLD_SIZE": str(self.world_size),
                           "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
                           "NODE_RANK": str(node_rank)})
        with _session.running(session):
            self._call_train_fn()
        return {"metrics": session.last_metrics, "checkpoint": session.last_checkpoint, "reports": session.reports}

    @guard_collectives
    def _call_train_fn(self):
        """The user's function, with or without its config; a collective's failure is a :class:`CollectiveError`."""
        if _takes_config(self.train_fn):
            self.train_fn(self.config)
        else:
            self.train_fn()


def _takes_config(fn):
    """Whether the training function takes the config (``train_func(config)``) or nothing (``train_func()``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)
