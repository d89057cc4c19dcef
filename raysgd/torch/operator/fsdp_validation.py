"""Validation of sharded models without gathering them: every rank runs the same forwards, exact metrics kept.

Layer 1 (torch only). Under FSDP2 every forward all-gathers each block's parameters from every rank, so the ranks
must run the same forwards in the same order. Exact validation shards differ by up to a batch (11 samples in
batches of 5 on 2 ranks: 2 batches and 1), and a rank may have none at all (fewer samples than ranks). Gathering the
whole models on every rank for the whole validation (``fsdp_args={"validation": "gathered"}``) avoids the problem
but needs each rank to hold the whole model, which a model that fits only sharded does not allow.

So by default the ranks validate sharded, in lockstep (:class:`LockstepBatches`, the iterator the operator's
``validate`` loop gets): before each batch the ranks exchange whether they still have one (one small all-gather);
when none has, validation ends on every rank; a rank that has run out while others have not *pads*: it runs its
last batch again through ``validate_batch`` (``batch_info["padding"]`` is True) and drops the result, so its forwards
match the others' and its metrics hold only its own samples. A rank that has had no batch at all pads with the
first batch of the lowest rank that has one (sent to it once). The metrics are those of the whole validation set,
sample-weighted, exactly as unsharded.

What this asks of an operator: that each batch runs the same forwards through the models on every rank (the default
``validate_batch`` does; a custom one that keeps state of its own, a list of predictions say, skips the batches whose
``batch_info["padding"]`` is True), and that a custom ``validate`` loop takes its batches from the iterator one at a
time, between forwards (as the default loop does). Where that does not hold, ``fsdp_args={"validation":
"gathered"}`` gathers each model once on every rank instead.

Example:
    >>> batches = LockstepBatches([1, 2], pad=None, group=None)  # no process group: the batches as they are
    >>> list(batches)
    [1, 2]
"""
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: ``fsdp_args["validation"]``: the models stay sharded (the default) or are gathered whole on every rank.
VALIDATION_MODES = ("sharded", "gathered")


class LockstepBatches:
    """The validation batches of one rank, advanced in lockstep with the other ranks of ``group`` (see the module
    docstring). ``pad(batch)`` runs one padding batch (its result dropped).

    Args:
        batches: this rank's batches (any iterable).
        pad: ``pad(batch)``, called when this rank has run out while another rank still has a batch.
        group: the models' process group (None: the default group; without one, the batches pass as they are).
    """

    def __init__(self, batches, pad, group=None):
        self._batches, self._pad, self._group = iter(batches), pad, group
        self._last, self._done = None, False
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.padded = 0

    def __iter__(self):
        return self

    def _own_next(self):
        if self._done:
            return False, None
        try:
            return True, next(self._batches)
        except StopIteration:
            self._done = True
            return False, None

    def __next__(self):
        while True:
            has, batch = self._own_next()
            if not self._distributed:
                if not has:
                    raise StopIteration
                return batch
            flags = self._exchange(has)
            if not any(has_one for has_one, _ in flags):
                raise StopIteration
            if any(not has_one and not had for has_one, had in flags):  # a rank without any batch yet: send one
                source = next(rank for rank, (has_one, _) in enumerate(flags) if has_one)
                sent = [batch if dist.get_rank(self._group) == source else None]
                dist.broadcast_object_list(sent, src=dist.get_global_rank(self._group, source)
                                           if self._group is not None else source, group=self._group)
                if self._last is None and not has:
                    self._last = sent[0]
            if has:
                self._last = batch
                return batch
            self.padded += 1
            self._pad(self._last)  # the others run their batch: the same forwards here, the result dropped

    def _exchange(self, has):
        """``[(has a batch now, has had one before), ...]`` of every rank (one all-gather)."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self._group) == "nccl" \
            else torch.device("cpu")
        mine = torch.tensor([int(has), int(self._last is not None)], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(gathered, mine, group=self._group)
        return [(bool(flags[0]), bool(flags[1])) for flags in (tensor.tolist() for tensor in gathered)]
