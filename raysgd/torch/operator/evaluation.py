"""Validation that issues no collective per batch, so ranks with different batch counts (or none) never hang.

Layer 1: imports torch and layer 0.

``DistributedDataParallel`` broadcasts its buffers (BatchNorm's running statistics) from rank 0 at
the start of a forward pass whenever the previous forward ran with gradients, so the first validation
forward after training is a collective. Exact validation shards differ by one sample, and a rank
whose shard is empty (fewer samples than workers, or ``drop_last``) runs no forward at all: the other
ranks would then wait in that broadcast until the process group's timeout.

:func:`quiet_forward` makes the broadcast explicit instead: it runs once, on every rank, when the
validation call starts (the same values DDP would have sent), and DDP's per-forward buffer sync is
turned off until the call ends.

Example:
    >>> model = torch.nn.Linear(2, 2)  # not DDP-wrapped (one process): nothing to do
    >>> with quiet_forward(ddp_modules(model)):
    ...     _ = model(torch.zeros(1, 2))
"""
import contextlib
import logging

import torch

from raysgd.torch.operator.compiled import find_ddp

logger = logging.getLogger(__name__)


def ddp_modules(*owners):
    """Every ``DistributedDataParallel`` among ``owners``, their attributes, and lists/tuples in those (a
    ``torch.compile``'d DDP counts as the DDP it wraps).

    Example:
        >>> class Op:
        ...     pass
        >>> op = Op(); op.models = [torch.nn.Linear(1, 1)]
        >>> ddp_modules(op)
        []
    """
    found: list[torch.nn.Module] = []

    def visit(value):
        ddp = find_ddp(value) if isinstance(value, torch.nn.Module) else None  # also inside torch.compile
        if ddp is not None:
            if not any(ddp is seen for seen in found):
                found.append(ddp)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for owner in owners:
        visit(owner)
        if not isinstance(owner, torch.nn.Module):
            for value in list(getattr(owner, "__dict__", {}).values()):
                visit(value)
    return found


@contextlib.contextmanager
def quiet_forward(models):
    """Sync the DDP ``models``' buffers once now (every rank must enter), then run forwards without collectives.

    On exit each model's forward sync flag is put back, so training continues as it would have.
    """
    saved = []
    try:
        for model in models:
            if model.will_sync_module_buffers():
                model._sync_buffers()  # the broadcast DDP would make at the first forward, on every rank
            # DDP's switch of the per-forward sync: forward_sync_buffers (newer torch) or broadcast_buffers (2.7)
            switch = "forward_sync_buffers" if "forward_sync_buffers" in vars(model) else "broadcast_buffers"
            saved.append((model, model.require_forward_param_sync, switch, getattr(model, switch)))
            setattr(model, switch, False)  # also when a custom validate runs with gradients on
        yield
    finally:
        for model, require_sync, switch, sync_buffers in saved:
            model.require_forward_param_sync = require_sync
            setattr(model, switch, sync_buffers)
