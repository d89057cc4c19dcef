"""The run: one controller that owns it, the worker group it drives, and the workers.

Layer 5 (Ray; layers 0-4). :class:`~raysgd.torch.execution.controller.RunController` owns a trainer's run (the
group, the restart point, failures, resizes, the commit policy and the durable run's hooks) and runs each call
through its attempts, starting and restarting the group with :mod:`~raysgd.torch.execution.restarts`. The
:class:`~raysgd.torch.execution.worker_group.WorkerGroup` places the workers (:mod:`~raysgd.torch.execution.placement`,
:mod:`~raysgd.torch.execution.cluster_state`), fans each call out to them (:mod:`~raysgd.torch.execution.worker_handle`,
:mod:`~raysgd.torch.execution.local_runner`) and collects the answers under deadlines
(:mod:`~raysgd.torch.execution.calls`); when a rank hangs, :mod:`~raysgd.torch.execution.diagnostics` takes every
rank's stacks. Each worker is a :class:`~raysgd.torch.execution.worker.TorchWorker` (its epochs:
:mod:`~raysgd.torch.execution.epoch_iterators`), the same class as an actor or in the driver; user classes reach
it by :mod:`~raysgd.torch.execution.shipping`'s rules. The policies it acts on are
:mod:`raysgd.torch.fault_tolerance`'s.

Example:
    >>> from raysgd.torch.execution.controller import RunController
    >>> RunController.check_max_retries(3)  # train(max_retries=3): accepted
"""
