"""``raysgd.train.collective``: Ray Train's ``barrier()`` and ``broadcast_from_rank_zero(data)`` for training functions.

Part of :mod:`raysgd.train`. Both run on the workers' own ``torch.distributed`` process group (gloo on CPU, NCCL on
GPUs: the tensors go on the worker's device), so every rank must call them, in the same order; a wait is bounded
by the process group's timeout (``TorchConfig(timeout_s)``), and a lost peer fails the collective, which the run
treats as a worker failure. Outside a training function they raise a ``RuntimeError``; with one worker they return
at once.

``broadcast_from_rank_zero`` is for small data, as in Ray Train: rank 0's ``data`` is pickled (cloudpickle) and
must be at most :data:`MAX_BROADCAST_BYTES` (1000) bytes, else every rank raises the same ``ValueError``. Data
that cannot be pickled raises on rank 0 (pickle's error, a ``TypeError`` or ``PicklingError``) and a ``TypeError``
on the others. (Ray Train 2.58 documents the ``ValueError``; its code only logs a warning.)

Example:
    >>> def train_func():  # doctest: +SKIP
    ...     from raysgd.train.collective import barrier, broadcast_from_rank_zero
    ...     rank = raysgd.train.get_context().get_world_rank()
    ...     run_id = broadcast_from_rank_zero(uuid.uuid4().hex if rank == 0 else None)  # the same on every rank
    ...     barrier()
    >>> barrier()
    Traceback (most recent call last):
    ...
    RuntimeError: raysgd.train.collective.barrier() works only inside the training function that TorchTrainer runs on its workers
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from ray import cloudpickle

from raysgd.train import session as _session
from typing import Any

#: The most bytes (pickled) ``broadcast_from_rank_zero`` sends, Ray Train's limit.
MAX_BROADCAST_BYTES = 1000
_UNPICKLABLE = -1  # the length rank 0 sends when its data cannot be pickled


def _group_device(session):
    """``(world size, device for the collective's tensors)``; size 1 when no process group is formed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, None
    device = session.device if dist.get_backend() == "nccl" else torch.device("cpu")
    return dist.get_world_size(), device


def barrier() -> None:
    """Wait until every rank has called ``barrier()`` (bounded by the process group's timeout).

    Example:
        >>> def train_func():  # doctest: +SKIP
        ...     if raysgd.train.get_context().get_world_rank() == 0:
        ...         download_dataset()
        ...     raysgd.train.collective.barrier()  # the others wait for it
    """
    session = _session.current("collective.barrier()")
    size, device = _group_device(session)
    if size > 1:
        dist.all_reduce(torch.zeros(1, device=device))  # a barrier on any backend, on this rank's device


def broadcast_from_rank_zero(data: Any) -> Any:
    """Rank 0's ``data`` on every rank (the others' ``data`` is ignored); a barrier too: every rank must call it.

    Raises ``ValueError`` when rank 0's data pickles to more than 1000 bytes (on every rank), and pickle's error
    when it cannot be pickled (see the module docstring).

    Example:
        >>> def train_func():  # doctest: +SKIP
        ...     rank = raysgd.train.get_context().get_world_rank()
        ...     config = broadcast_from_rank_zero({"lr": 0.1} if rank == 0 else None)
    """
    session = _session.current("collective.broadcast_from_rank_zero()")
    size, device = _group_device(session)
    rank = session.context.get_world_rank() if size > 1 else 0
    payload, pickle_error = b"", None
    if rank == 0:
        try:
            payload = cloudpickle.dumps(data)
        except Exception as err:  # noqa: BLE001 (re-raised below, after the other ranks are told)
            pickle_error = err
    length: Any = torch.tensor([_UNPICKLABLE if pickle_error else len(payload)], dtype=torch.int64, device=device)
    if size > 1:
        dist.broadcast(length, src=0)
    length = int(length.item())
    if length == _UNPICKLABLE:
        if pickle_error is not None:
            raise pickle_error
        raise TypeError("raysgd.train.collective.broadcast_from_rank_zero: rank 0's data cannot be pickled (rank 0 "
                        "raised the cause)")
    if length > MAX_BROADCAST_BYTES:
        raise ValueError(f"raysgd.train.collective.broadcast_from_rank_zero: rank 0's data is {length} bytes pickled; "
                         f"the limit is {MAX_BROADCAST_BYTES} bytes (as in Ray Train): send a path or a small summary "
                         f"instead")
    buffer = torch.empty(length, dtype=torch.uint8, device=device)
    if rank == 0:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if size > 1:
        dist.broadcast(buffer, src=0)
    return cloudpickle.loads(buffer.cpu().numpy().tobytes())


__all__ = ["MAX_BROADCAST_BYTES", "barrier", "broadcast_from_rank_zero"]
