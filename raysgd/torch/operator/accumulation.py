"""Gradient accumulation for a fixed global batch: micro-batches per optimizer step, ``no_sync``, the partial flush.

Layer 1 (torch and layer 0). With ``TorchTrainer(fixed_worker_batch=True)`` every worker trains on
``BATCH_SIZE / max_workers`` samples per micro-batch at every size, and with ``n`` workers one optimizer
step accumulates ``k = round(max_workers / n)`` micro-batches, so that the optimizer sees the same global
batch whatever the size. The trainer puts ``k`` in the worker config under ``ACCUMULATION_STEPS``; the
operator reads it as ``operator.accumulation_steps``. Inner micro-batches run under every DDP model's
``no_sync()`` (no allreduce); the last one synchronises and steps. :class:`AccumulationHelpers` is the operator's
side (a mixin of :class:`~raysgd.torch.training_operator.TrainingOperator`): the default loop tracks the
micro-batches of the running optimizer step with it, and the committer asks it whether the loop stands at an
optimizer-step boundary (:meth:`AccumulationHelpers.at_step_boundary`), the only place a commit may land.

How a worker's config gets ``k`` and the per-worker batch: :mod:`raysgd.torch.sharding.batch_split`;
``fixed_worker_batch`` and what it needs are checked with the trainer's options (:mod:`raysgd.torch.options`).

Example:
    >>> tracker = Tracker(steps=2)  # two micro-batches per optimizer step
    >>> first = tracker.next_info(); tracker.done(first); second = tracker.next_info()
    >>> first, second
    ({'micro_step': 0, 'step_now': False}, {'micro_step': 1, 'step_now': True})
"""
import contextlib
import logging
from typing import Any, Callable

import torch.distributed as dist

from raysgd.torch.operator.compiled import find_ddp
from raysgd.torch.constants import ACCUMULATION_STEPS

logger = logging.getLogger(__name__)


class Tracker:
    """Where the running optimizer step is: ``pending`` micro-batches accumulated since the last step."""

    def __init__(self, steps):
        self.steps, self.pending = steps, 0

    def next_info(self):
        """``micro_step`` (0 .. k-1) and ``step_now`` (this micro-batch ends the optimizer step) of the next batch."""
        return {"micro_step": self.pending, "step_now": self.pending + 1 >= self.steps}

    def done(self, info):
        self.pending = 0 if info["step_now"] else self.pending + 1


def zero_grad_now(info):
    """Whether a ``train_batch`` should zero the gradients: at the first micro-batch of a step."""
    return info.get("micro_step", 0) == 0


class AccumulationHelpers:
    """The operator's micro-batches: ``accumulate()``, ``accumulation_steps``, ``at_step_boundary()`` and the default
    loop's tracking (``self._models``, ``self._optimizers`` and ``self.step`` come from the operator).

    Example:
        >>> class Op(AccumulationHelpers):
        ...     _config = {"*accumulation_steps": 2}
        >>> op = Op()
        >>> op.accumulation_steps, op.at_step_boundary()
        (2, True)
        >>> tracker = op._begin_accumulation()
        >>> tracker.done(tracker.next_info()); op.at_step_boundary()  # one micro-batch of two taken
        False
    """

    # provided by the host class (TrainingOperator)
    _config: dict
    _optimizers: list[Any]
    step: Callable[..., None]
    train_batch: Callable[..., Any]

    _accumulation = None  # the Tracker of the running train_epoch
    _accumulation_warned = False

    @property
    def accumulation_steps(self):
        """Micro-batches per optimizer step: ``max_workers / num_workers`` with ``fixed_worker_batch=True``, else 1."""
        return int(self._config.get(ACCUMULATION_STEPS, 1))

    def accumulate(self, step_now=True):
        """Context for a micro-batch's forward and backward: every DDP model's ``no_sync()`` unless ``step_now``
        (see :mod:`raysgd.torch.operator.accumulation` and docs/fault-tolerance/commits.md, "The global batch",
        for custom ``train_batch`` code).
        Example:
            >>> # with self.accumulate(batch_info["step_now"]): loss = ...; self.backward(loss / k, optimizer)
        """
        stack = contextlib.ExitStack()
        if not step_now:
            for model in self._ddp_models():
                stack.enter_context(model.no_sync())
        return stack

    def at_step_boundary(self):
        """True unless micro-batches wait for their optimizer step (a commit must not land there: grads aren't
        state). The committer asks it between two batches."""
        return self._accumulation is None or self._accumulation.pending == 0

    def _ddp_models(self):
        """The DDP-wrapped registered models (and ``self.model`` if it is one)."""
        models = [ddp for ddp in map(find_ddp, getattr(self, "_models", None) or ()) if ddp is not None]
        own = find_ddp(getattr(self, "model", None))  # a torch.compile'd DDP counts as the DDP inside
        if own is not None and all(own is not m for m in models):
            models.append(own)
        return models

    def _begin_accumulation(self):
        """A new :class:`Tracker` for a ``train_epoch`` (no micro-batch pending: a failed call left none)."""
        self._accumulation = found = Tracker(self.accumulation_steps)
        custom = getattr(type(self).train_batch, "__qualname__", "") != "TrainingOperator.train_batch" \
            if hasattr(type(self), "train_batch") else False
        if found.steps > 1 and custom and not self._accumulation_warned:
            self._accumulation_warned = True
            logger.warning("fixed_worker_batch: %s.train_batch must honour batch_info['micro_step'] and ['step_now'] "
                           "(see TrainingOperator.accumulate); %d micro-batches make one optimizer step.",
                           type(self).__name__, found.steps)
        return found

    def _flush_accumulation(self):
        """Step an optimizer step left partial at the end of an epoch or call; True when it stepped.

        Its last micro-batch skipped the allreduce, so the gradients are averaged across ranks here,
        then rescaled from ``1/k`` to ``1/m`` for the ``m`` micro-batches that ran.
        """
        found = self._accumulation
        if found is None or found.pending == 0:
            return False
        scale = found.steps / found.pending
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        synced = {id(p) for m in self._ddp_models() for p in m.parameters()}
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if distributed and id(param) in synced:
                        dist.all_reduce(param.grad)
                        param.grad.div_(dist.get_world_size())
                    param.grad.mul_(scale)
        self.step(*self._optimizers)
        found.pending = 0
        return True

    def _scale_for_accumulation(self, loss):
        """A micro-batch's loss scaled by ``1 / accumulation_steps`` (unchanged at 1: bit-identical to no accumulation)."""
        steps = self.accumulation_steps
        return loss if steps == 1 else loss / steps
