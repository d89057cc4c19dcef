"""The function worker: a :class:`~raysgd.torch.execution.worker.TorchWorker` that runs a Ray Train training function.

Part of :mod:`raysgd.train`. The worker group starts it as it starts a ``TorchWorker`` (the same placement,
rendezvous and gloo/NCCL process group, the same failure detection, warm spares and survivors kept in their
processes): only the work differs. Instead of an operator, :meth:`FunctionWorker.setup_operator` picks the device,
and :meth:`FunctionWorker.run_loop` runs ``train_loop_per_worker(config)`` inside a
:class:`~raysgd.train.session.Session` whose ``report()`` is the run's commit point (:mod:`raysgd.train.reporting`).
While it runs, a SIGTERM waits for the next ``report()`` (:mod:`raysgd.torch.commits.preemption`), and the
driver reads rank 0's reports from the actor's ``"control"`` concurrency group (:meth:`FunctionWorker.take_reports`).
A torch.distributed timeout or lost peer becomes :class:`~raysgd.torch.errors.CollectiveError` (a worker failure);
any other exception is the user's (retried under ``FailureConfig(max_failures)`` as in Ray Train).

As in Ray Train, ``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
and ``NODE_RANK`` are set, and with GPUs every worker of a node sees the GPUs of all the node's workers
(``CUDA_VISIBLE_DEVICES``, each GPU once), and its device is its own first GPU there, as Ray Train's
``get_device()``: ``cuda:{local_rank}`` with one GPU per worker.

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
import threading

import torch

from raysgd.torch.execution.worker import TorchWorker, guard_collectives
from raysgd.torch.commits import preemption
from raysgd.train import session as _session

logger = logging.getLogger(__name__)


class FunctionWorker(TorchWorker):
    """One rank running a training function (see the module docstring); ``operator_cls`` is the function."""

    #: No operator state to snapshot beside a call: the function keeps its own state in its checkpoints.
    overlaps_snapshots = False

    def __init__(self, train_fn, config, **options):
        super().__init__(train_fn, config, **options)
        self.train_fn = train_fn
        self.device, self.local_rank = torch.device("cpu"), 0
        self._session = None  # the running session (take_reports reads its reporter from the control thread)
        self._lock = threading.Lock()

    def setup_process_group(self, url, world_rank, world_size, timeout_s):
        """Join the process group (see :meth:`TorchWorker.setup_process_group`) and name its rendezvous as
        ``MASTER_ADDR``/``MASTER_PORT``, as Ray Train does."""
        address, _, port = url[len("tcp://"):].rpartition(":")
        os.environ.update({"MASTER_ADDR": address, "MASTER_PORT": port})
        super().setup_process_group(url, world_rank, world_size, timeout_s)

    def gpu_ids(self):
        """``(node id, [GPU ids Ray assigned this worker])``: the driver gives each worker the GPUs of its node's
        workers (:meth:`_pick_device`)."""
        import ray  # noqa: PLC0415 (only for the ids; the worker itself needs no Ray)

        return ray.get_runtime_context().get_node_id(), [str(gpu) for gpu in ray.get_gpu_ids()]

    def setup_operator(self, local_rank=0):
        """No operator: remember the local rank and pick the device (``cuda:{local_rank}`` with GPUs)."""
        self.local_rank = local_rank
        self._pick_device()

    def _pick_device(self, node_gpus=None, own_gpus=None):
        """The device: the CPU, or with GPUs this worker's. ``node_gpus`` (the GPU ids of this node's workers in
        local-rank order; a GPU that fractional workers share comes once) are all made visible while CUDA has not
        started in this process, and the device is the first of ``own_gpus`` (this worker's ids) there, as in Ray
        Train (``cuda:{local_rank}`` without them); a process whose CUDA already started keeps its device."""
        self.device = torch.device("cpu")
        if not self.use_gpu:
            return
        visible = list(dict.fromkeys(node_gpus or ()))  # CUDA stops reading CUDA_VISIBLE_DEVICES at a repeated id
        if visible and not torch.cuda.is_initialized():
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        if torch.cuda.is_available():
            own = [visible.index(gpu) for gpu in own_gpus or () if gpu in visible]
            if torch.cuda.is_initialized():
                index = torch.cuda.current_device()
            elif own:  # GPUs 2 and 3 of a worker of two GPUs: cuda:2, not cuda:{local_rank} (another worker's)
                index = min(own)
            else:
                index = self.local_rank if self.local_rank < torch.cuda.device_count() else 0
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)

    def run_loop(self, run_info, plan=None, local_world_size=1, node_rank=0, dataset_shards=None, node_gpus=None,
                 progress=None, own_gpus=None):
        """Run the training function once (one attempt); returns ``{"reports", "return_value"}`` of this rank:
        rank 0's reports the driver has not taken yet, and the function's return value.

        ``run_info``: ``{"name", "storage_path"}`` (its context); ``plan``: the attempt's
        :class:`~raysgd.train.reporting.ReportPlan`; ``node_gpus``, ``own_gpus``: see :meth:`_pick_device`;
        ``progress``: rank 0's feed of the driver's progress bar (``RunConfig(progress_bar=True)``)."""
        if node_gpus:
            self._pick_device(node_gpus, own_gpus)
        context = _session.TrainContext(self.world_size, self.world_rank, self.local_rank, local_world_size,
                                        node_rank, run_info["name"], run_info["storage_path"])
        session = _session.Session(context, self.device, plan, dataset_shards=dataset_shards, backend=self.backend,
                                   progress=progress)
        os.environ.update({"RANK": str(self.world_rank), "WORLD_SIZE": str(self.world_size),
                           "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
                           "NODE_RANK": str(node_rank)})
        with self._lock:
            self._session = session
        preemption.set_active(True)  # a SIGTERM now waits for the next report (the commit point)
        try:
            with _session.running(session):
                value = self._call_train_fn()
        finally:
            preemption.set_active(False)
            preemption.drop_pending()
            session.close()
        return {"reports": self.take_reports(), "return_value": value if self.world_rank == 0 else None}

    def take_reports(self):
        """Rank 0's reports since the last take (the driver polls them from the ``"control"`` group while the
        function runs); empty on other ranks or before the function started."""
        with self._lock:
            session = self._session
        reporter = session.reporter if session is not None else None
        return reporter.take() if reporter is not None else []

    @guard_collectives
    def _call_train_fn(self):
        """The user's function, with or without its config; a collective's failure is a :class:`CollectiveError`."""
        if _takes_config(self.train_fn):
            return self.train_fn(self.config)
        return self.train_fn()


def signature_problem(fn):
    """Why ``fn`` cannot run as a training function, called ``fn(config)`` or ``fn()`` (see :func:`_takes_config`):
    more than one required positional argument (Ray Train refuses them too) or a required keyword-only one; None
    when it can (or its signature cannot be read).

    Example:
        >>> signature_problem(lambda config: None) is None, signature_problem(lambda: None) is None
        (True, True)
        >>> signature_problem(lambda model, config: None), signature_problem(lambda *, config: None)
        ('2 required arguments (model, config)', 'the required keyword-only argument config')
    """
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    required = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                                  p.POSITIONAL_OR_KEYWORD)]
    keyword = [p.name for p in parameters if p.default is p.empty and p.kind == p.KEYWORD_ONLY]
    if len(required) > 1:
        return f"{len(required)} required arguments ({', '.join(required)})"
    if keyword:
        return f"the required keyword-only argument{'s' if len(keyword) > 1 else ''} {', '.join(keyword)}"
    return None


def _takes_config(fn):
    """Whether the training function takes the config (``train_func(config)``) or nothing (``train_func()``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)
