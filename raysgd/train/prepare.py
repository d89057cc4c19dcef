"""``prepare_model``, ``prepare_data_loader`` and ``get_device``: a rank's model and data inside the training function.

Part of :mod:`raysgd.train` (the functions of ``raysgd.train.torch``). ``prepare_data_loader`` shards a map-style
``DataLoader`` with raysgd's sampler (:func:`raysgd.torch.sharding.loaders.shard_loader`: every rank reads every
``world_size``-th position of the epoch's stream, drawn from ``(seed, epoch)``) and returns a
:class:`PreparedLoader`, which counts the batches it hands out. With ``exactly_once=True`` (the default) a
checkpoint reported mid-epoch carries the loader's data cursor (the positions every rank consumed), and after a
restart the loader's pass of that epoch starts at the cursor, re-sharded over the current world size: every sample
of the epoch is trained once. Which epoch a pass is: the one given to ``loader.sampler.set_epoch(epoch)`` (or
``loader.set_epoch``) before it (the same epoch again counts too), else the previous pass's plus one; a loader
restored from a cursor starts at the cursor's epoch (the next one when that epoch was complete). The restored cursor
applies to the first pass only, and only when that pass is its epoch: a pass of an epoch the cursor says was trained
whole yields nothing.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> loader = PreparedLoader(DataLoader(list(range(6)), batch_size=2), world_rank=0, world_size=1,
    ...                         device=torch.device("cpu"), restored={"epoch": 0, "consumed": 4, "complete": False})
    >>> [batch.tolist() for batch in loader]  # the pass resumes after the 4 positions already trained
    [[4, 5]]
    >>> loader.cursor_state()
    {'epoch': 0, 'consumed': 6, 'complete': True, 'positions': 6}
"""
from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from raysgd.base.checks import expect
from raysgd.torch.sharding import loaders as _loaders
from raysgd.torch.sharding.epoch_order import stream_length
from raysgd.train import session as _session
from typing import Any, Iterator, cast

logger = logging.getLogger(__name__)

def get_device() -> torch.device:
    """This worker's device: ``cuda:<index>`` with ``ScalingConfig(use_gpu=True)``, else ``cpu``.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     tensor = torch.zeros(3, device=raysgd.train.torch.get_device())
    """
    return _session.current("torch.get_device()").device


def prepare_model(model: torch.nn.Module, move_to_device: bool | torch.device = True, parallel_strategy: str | None = "ddp",
                  parallel_strategy_kwargs: dict[str, Any] | None = None) -> torch.nn.Module:
    """Move ``model`` to this worker's device and wrap it in ``DistributedDataParallel`` when there are several
    workers (``parallel_strategy=None``: no wrap). FSDP is not supported here (``NotImplementedError``).

    ``move_to_device``: True moves the model to :func:`get_device`, a ``torch.device`` to that device (as in Ray
    Train), False leaves it where it is. ``parallel_strategy_kwargs`` go to ``DistributedDataParallel``; on a GPU
    its ``device_ids`` and ``output_device`` default to the model's device, and a value given there wins.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     model = raysgd.train.torch.prepare_model(torch.nn.Linear(4, 1))
    """
    session = _session.current("torch.prepare_model()")
    expect(isinstance(model, torch.nn.Module), "model", "a torch.nn.Module", model, TypeError, "prepare_model",
           call=True, got=type(model).__name__)
    if parallel_strategy not in ("ddp", None):
        raise NotImplementedError(f"prepare_model(parallel_strategy={parallel_strategy!r}): raysgd.train supports "
                                  "'ddp' or None; for FSDP wrap the model yourself (torch.distributed.fsdp) inside "
                                  "the training function")
    kwargs = parallel_strategy_kwargs if parallel_strategy_kwargs is not None else {}
    expect(isinstance(kwargs, dict) and all(isinstance(key, str) for key in kwargs), "parallel_strategy_kwargs",
           "None or a dict of DistributedDataParallel's keyword arguments", parallel_strategy_kwargs, TypeError,
           "prepare_model", call=True, typed=True)
    device = move_to_device if isinstance(move_to_device, torch.device) else session.device
    if move_to_device:
        model = model.to(device)
    if parallel_strategy == "ddp" and session.context.get_world_size() > 1:
        if device.type == "cuda":  # the user's device_ids or output_device win, as in Ray Train
            kwargs = {"device_ids": [device], "output_device": device, **kwargs}
        model = DistributedDataParallel(model, **kwargs)
    return model


def prepare_data_loader(data_loader: DataLoader, add_dist_sampler: bool = True, move_to_device: bool = True,
                        auto_transfer: bool = True, exactly_once: bool = True) -> PreparedLoader | DataLoader:
    """Shard ``data_loader`` for this worker (raysgd's sampler and data cursor) and move its batches to the device.

    ``exactly_once``: save the loader's data cursor with every checkpoint reported, and continue a restored
    epoch from it after a restart (see the module docstring). ``add_dist_sampler=False`` keeps the loader's own
    sampler (no sharding, no cursor). A loader that cannot be sharded (an ``IterableDataset``, a
    ``DistributedSampler`` of the user's) passes through without a cursor. A loader this function returned is
    returned as it is (not sharded twice).

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     loader = raysgd.train.torch.prepare_data_loader(DataLoader(dataset, batch_size=32, shuffle=True))
        ...     for epoch in range(start_epoch, 10):
        ...         loader.sampler.set_epoch(epoch)
        ...         for x, y in loader: ...
    """
    session = _session.current("torch.prepare_data_loader()")
    if isinstance(data_loader, PreparedLoader) and data_loader in session.loaders:
        return data_loader  # prepared already (a loop preparing it again, as Ray Train allows): sharded once
    expect(isinstance(data_loader, DataLoader), "data_loader", "a torch.utils.data.DataLoader", data_loader,
           TypeError, "prepare_data_loader", call=True, got=type(data_loader).__name__)
    context = session.context
    prepared = PreparedLoader(data_loader, context.get_world_rank(), context.get_world_size(), session.device,
                              shard=add_dist_sampler, move_to_device=move_to_device,
                              exactly_once=exactly_once,
                              progress=session.progress if not session.loaders else None)  # the first: training's
    index = session.add_loader(prepared)
    if exactly_once:
        prepared.restore(session.restored_cursor(index))
    return prepared


class PreparedLoader:
    """A sharded ``DataLoader`` that moves batches to the device and keeps its data cursor (see the module
    docstring). Other attributes (``sampler``, ``dataset``, ``batch_size``) are the sharded loader's, except that
    ``sampler`` is raysgd's shard of a custom ``batch_sampler`` (so ``loader.sampler.set_epoch(epoch)``, Ray Train's
    loop, works for every loader raysgd shards)."""

    def __init__(self, loader, world_rank, world_size, device, shard=True, move_to_device=True, exactly_once=True,
                 restored=None, progress=None):
        self.loader = _loaders.shard_loader(loader, world_rank, world_size, training=True) if shard else loader
        self._rank = world_rank
        self.device, self.move_to_device, self.exactly_once = device, move_to_device, exactly_once
        self._sampler = _loaders.shard_sampler(self.loader)
        if exactly_once and self._sampler is None and world_rank == 0:
            logger.warning("prepare_data_loader: this DataLoader has no data cursor (%s); a restart re-reads its "
                           "epoch from the start", "not sharded" if not shard else "not shardable by raysgd")
        self._calls_seen = getattr(self._sampler, "set_epoch_calls", 0)  # set_epoch calls before the next pass
        self._passes, self._pass_epoch, self._taken, self._in_pass = 0, None, 0, False
        self._restored = None
        self._progress = progress  # rank 0's progress bar feed (RunConfig(progress_bar=True)), or None
        self.restore(restored)

    def restore(self, cursor: dict | None) -> None:
        """Continue from ``cursor`` (a :meth:`cursor_state` from a checkpoint) at the first pass of its epoch."""
        if cursor is None or self._sampler is None or not self.exactly_once:
            return
        self._restored = dict(cursor)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (as ``loader.sampler.set_epoch``)."""
        _loaders.set_sampler_epoch(self.loader, epoch)

    def _begin_pass(self):
        """Pick the pass's epoch (see the module docstring) and apply a restored cursor of that epoch."""
        sampler, restored, self._restored = self._sampler, self._restored, None
        if sampler is None:
            return
        explicit = sampler.set_epoch_calls != self._calls_seen  # the caller named this pass's epoch
        if explicit:
            epoch = sampler.epoch
        elif self._passes == 0:
            epoch = sampler.epoch if restored is None else restored["epoch"] + (1 if restored["complete"] else 0)
        else:
            epoch = cast(int, self._pass_epoch) + 1  # set by the first pass
        sampler.set_epoch(epoch)
        self._calls_seen, self._pass_epoch = sampler.set_epoch_calls, epoch
        if restored is not None:
            if restored["epoch"] == epoch:  # a complete one leaves nothing of the epoch to read: an empty pass
                _loaders.set_sampler_start(self.loader, _loaders.resumed_start(  # another length: a resize
                    self.loader, int(restored["consumed"]), restored.get("positions"), warn=self._rank == 0))
                logger.info("Epoch %d resumes at the data cursor %d%s", epoch, restored["consumed"],
                            " (the whole epoch was trained)" if restored["complete"] else "")
            elif not restored["complete"]:
                logger.info("The restored data cursor (epoch %d) does not apply: this pass is epoch %d",
                            restored["epoch"], epoch)

    def __iter__(self) -> Iterator[Any]:
        self._begin_pass()
        self._passes += 1
        self._taken, self._in_pass = 0, True
        progress = self._progress
        if progress is not None:
            progress.begin(total=stream_length(self.loader))  # None: no length
        info = {"epoch_idx": self._pass_epoch or 0}
        for batch in self.loader:
            self._taken += 1
            yield _loaders.to_device(batch, self.device) if self.move_to_device else batch
            if progress is not None:
                progress(self._taken - 1, _session.last_metrics(), info)
        self._in_pass = False
        if progress is not None:
            progress.end()

    def cursor_state(self) -> dict[str, Any] | None:
        """``{"epoch", "consumed", "complete", "positions"}`` now (positions all ranks consumed in the current pass,
        of the pass's stream of ``positions``), or None."""
        if self._sampler is None or not self.exactly_once or self._pass_epoch is None:
            return None
        total = self._sampler.total
        consumed = _loaders.loader_cursor(self.loader, self._taken) if self._in_pass else total
        if consumed is None:
            return None
        return {"epoch": self._pass_epoch, "consumed": int(consumed), "complete": consumed >= total,
                "positions": int(total)}

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        if name == "loader":  # not set yet: no recursion
            raise AttributeError(name)
        if name == "sampler":  # a custom batch_sampler's shard, not the SequentialSampler DataLoader made beside it
            shard = _loaders.shard_sampler(self.loader, _loaders.SHARD_SAMPLERS)
            if shard is not None:
                return shard
        return getattr(self.loader, name)
