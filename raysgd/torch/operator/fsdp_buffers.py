"""The buffers of a sharded model, kept the same on every rank as DistributedDataParallel keeps them.

Layer 1 (torch only). FSDP2's ``fully_shard`` shards parameters and leaves buffers (BatchNorm's running statistics,
its ``num_batches_tracked``, any ``register_buffer``) alone: every rank updates its own copy from its own batches,
so after a few steps rank 0's ``running_var`` and rank 1's differ. DCP then saves one rank's copy (whichever its
planner picks), ``get_model()`` returns rank 0's, and each rank validates with its own.

raysgd gives a sharded model DDP's semantics (``broadcast_buffers=True``), which is what a user switching
``strategy="ddp"`` to ``"fsdp"`` already has:

- **rank 0's buffers are authoritative**: at the start of a model's forward, when its previous forward ran with
  gradients enabled, rank 0's buffers are broadcast to every rank (DDP's ``require_forward_param_sync``); the first
  forward after sharding broadcasts too (DDP broadcasts at construction);
- **before any state is read** (:meth:`BufferSync.sync`, called unconditionally): a snapshot, a commit, a checkpoint
  (``save``, ``storage_path``), ``get_model()`` and validation all see rank 0's buffers, on every rank. This is the
  broadcast the next training forward would make anyway, so it changes nothing that training computes: a run that
  is restarted from a commit ends bit-identical to one that is not, buffers included, and ``get_model()``, the
  checkpoint and every rank's validation hold the same buffers.

One broadcast per sync: every buffer of the model viewed as bytes and concatenated, so any mix of dtypes (float
statistics, int64 counters) travels bit-exact in one collective. Buffers are written through ``.data``, so their
version counters do not move: a graph that saved a buffer (a second forward before the backward, BatchNorm in eval
mode) is not invalidated, as DDP ensures with its own ``_unsafe_preserve_version_counter``.

Example:
    >>> model = torch.nn.BatchNorm1d(3)
    >>> sync = BufferSync(model, group=None)  # no process group: a no-op, nothing is hooked
    >>> sync.active, [name for name, _ in sync.named_buffers()]
    (False, ['running_mean', 'running_var', 'num_batches_tracked'])
"""
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def _bytes_of(tensor):
    """``tensor``'s bytes as a flat uint8 tensor (a view when it is contiguous)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)


class BufferSync:
    """Keeps ``model``'s buffers equal to rank 0's over ``group`` (see the module docstring); a no-op when the model
    has no buffers or there is no process group (``group=None`` and none initialised, or one rank).

    Args:
        model: the root module (FSDP-sharded; its buffers are plain tensors).
        group: the process group of the model's mesh (None: the default group, if one is initialised).
    """

    def __init__(self, model, group=None):
        self._model, self._group = model, group
        self._pending = True  # DDP broadcasts at construction: the first forward does here
        self._quiet = False
        self._hooks = []
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.active = distributed and bool(self.named_buffers())
        if self.active:
            self._src = dist.get_global_rank(group, 0) if group is not None else 0
            self._hooks = [model.register_forward_pre_hook(torch.compiler.disable(self._before_forward)),
                           model.register_forward_hook(self._after_forward)]

    def named_buffers(self):
        """``[(name, buffer)]`` of the model (the current tensors: a buffer reassigned since is followed)."""
        return [(name, buffer) for name, buffer in self._model.named_buffers()
                if buffer is not None and not hasattr(buffer, "to_local")]  # (a DTensor buffer is sharded: not ours)

    def _before_forward(self, module, args):
        if self._pending and not self._quiet:
            self.sync()

    def _after_forward(self, module, args, output):
        if not self._quiet:
            self._pending = torch.is_grad_enabled()  # DDP: the next forward syncs after one that ran with gradients

    def sync(self):
        """Broadcast rank 0's buffers to every rank now (a collective of the group: every rank calls it)."""
        self._pending = False
        if not self.active:
            return
        buffers = [buffer for _, buffer in self.named_buffers()]
        with torch.no_grad():
            flat = torch.cat([_bytes_of(buffer) for buffer in buffers])
            dist.broadcast(flat, src=self._src, group=self._group)
            offset = 0
            for buffer in buffers:
                size = buffer.numel() * buffer.element_size() if buffer.dtype != torch.bool else buffer.numel()
                piece = flat[offset:offset + size]
                offset += size
                value = piece.to(torch.bool) if buffer.dtype == torch.bool else piece.view(buffer.dtype)
                buffer.data.copy_(value.view(buffer.shape))  # through .data: the version counter stays

    def quiet(self, quiet):
        """No broadcast at forwards while ``quiet`` (validation: ranks may run different numbers of forwards; they
        synced once when it started). Leaving it, the next forward syncs only after one with gradients again."""
        self._quiet = bool(quiet)
        if quiet:
            self._pending = False

    def remove(self):
        """Remove the hooks (the model is no longer sharded by this operator)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
