"""The reading end of DCP's format: a ``StorageReader`` that loads any share of a sharded checkpoint at any world
size, reading only the bytes that share needs, from memory, an object store or files.

Layer 2 (torch only: no Ray, no files). :class:`BlobReader` is a ``torch.distributed.checkpoint`` (DCP)
``StorageReader`` (DCP's public reader interface) over a *source*: an object whose ``read(relative_path, [(offset,
length), ...])`` returns those byte ranges of a file (:class:`WholeFiles` over whole buffers;
:class:`~raysgd.torch.restart_points.restart_point.PartRanges` over an object store;
:class:`~raysgd.torch.storage.dcp_files.FileRanges` over files). It reads DCP's metadata and the planner's
``ReadItem``\\ s (public) and, of each stored item, only the rows the plan asks for, using the writer's layout
(:attr:`~raysgd.torch.state.dcp_blobs.BlobWriter.layout`): a rank of a resharded load reads its new shard and the
replicated values, not the whole files (nor whole items) that overlap it.

Why not DCP's ``FileSystemReader``: it reads every item it needs whole through one stream per file and
``torch.load``\\ s it, so a rank of 2 -> 4 reads twice its shard, and it cannot read from an object store. What this
reader relies on beyond DCP's public classes: where an item lies (``relative_path``, ``offset``, ``length`` of the
storage record ``FileSystemWriter`` puts in the metadata) and, for a row range, that ``torch.save`` stores a tensor's
bytes uncompressed in row-major order (the layout, found when the item was written). An item without a layout (a
folder ``FileSystemWriter`` wrote) is read whole and loaded with ``torch.load(weights_only=True)``, as
``FileSystemReader`` does, and :class:`BlobReader` loads what ``FileSystemWriter`` wrote.

Example:
    >>> # dcp.load(state_dict, storage_reader=BlobReader(metadata, WholeFiles({name: blob}.__getitem__), layout))
    >>> [bytes(piece) for piece in WholeFiles({"f": b"abcdef"}.__getitem__).read("f", [(1, 2)])]
    [b'bc']
"""
import io
import logging
import pickle
import warnings
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from raysgd.base.checks import expect
from raysgd.torch.errors import CheckpointError
from raysgd.torch.state.dcp_blobs import ViewFile, as_metadata, layout_key

logger = logging.getLogger(__name__)


class WholeFiles:
    """A source over ``fetch(relative_path) -> buffer`` (a whole file): each file fetched once, its ranges sliced
    from it without a copy. :attr:`pulled` counts the bytes fetched.

    Example:
        >>> source = WholeFiles({"f": b"abcdef"}.__getitem__)
        >>> [bytes(piece) for piece in source.read("f", [(1, 2), (4, 2)])], source.pulled
        ([b'bc', b'ef'], 6)
    """

    def __init__(self, fetch):
        self.fetch, self.pulled = fetch, 0

    def read(self, relative_path, ranges):
        data = memoryview(self.fetch(relative_path))
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self.pulled += data.nbytes
        return [data[offset:offset + length] for offset, length in ranges]


def as_source(fetch_or_source):
    """A source (``read(relative_path, ranges)``) as it is, a ``fetch(relative_path)`` callable as :class:`WholeFiles`."""
    if hasattr(fetch_or_source, "read"):
        return fetch_or_source
    expect(callable(fetch_or_source), "load_parts", "fetch(relative_path) -> bytes or a source with "
           "read(relative_path, ranges)", fetch_or_source, TypeError)
    return WholeFiles(fetch_or_source)


def _narrow(tensor, offsets, lengths):
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class BlobReader(StorageReader):
    """A DCP ``StorageReader`` over a source of files (see the module docstring): ``source.read(relative_path,
    ranges)`` (or a plain ``fetch(relative_path)``, read whole: :class:`WholeFiles`).

    The source is asked once per file this rank's load plan needs (never for another), for the byte ranges of the
    items it reads: with a ``layout`` only the rows of a tensor item the plan asks for, else whole items. Byte items
    (the non-tensor values) are checked with a safe load (``weights_only=True``) before DCP's planner unpickles them,
    unless ``weights_only=False``; raw tensor bytes unpickle nothing. After the load :attr:`stats` holds
    ``{"read": bytes the source delivered, "needed": bytes the loaded values take, "files": files read}``.

    Args:
        metadata: the checkpoint's ``Metadata`` or its bytes (read safely unless ``weights_only=False``).
        source: the files' source, or ``fetch(relative_path) -> buffer``.
        layout: ``{item key: raw data offset}`` (:attr:`BlobWriter.layout`), or None.
        weights_only: load byte items and the metadata only if a safe load accepts them.

    Example:
        >>> from raysgd.torch.state.dcp_blobs import metadata_to_bytes
        >>> from torch.distributed.checkpoint.metadata import Metadata
        >>> BlobReader(metadata_to_bytes(Metadata({})), source=None).read_metadata().state_dict_metadata
        {}
    """

    def __init__(self, metadata, source, layout=None, weights_only=True):
        super().__init__()
        self.metadata = as_metadata(metadata, weights_only=weights_only)
        self.source: Any = source if source is None else as_source(source)  # duck-typed: read(relative_path, ranges)
        self.layout, self.weights_only = dict(layout or {}), weights_only
        self.stats = {"read": 0, "needed": 0, "files": 0}
        self._chunks = None

    def reset(self, checkpoint_id=None):
        """Nothing to reset: the reader holds no state between loads."""

    def read_metadata(self, *args, **kwargs):
        """The checkpoint's metadata (given, not read)."""
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        """Check that the metadata says where its items lie."""
        if metadata.storage_data is None:
            raise CheckpointError("DCP metadata expected with storage_data (where each item lies); got none")

    def prepare_local_plan(self, plan):
        """The planner's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans):
        """The planners' plans, unchanged."""
        return plans

    def _chunk_sizes(self, index):
        """The saved chunk's sizes and dtype of a tensor item (``(sizes, dtype)``), from DCP's metadata."""
        if self._chunks is None:
            self._chunks = {}
            for fqn, entry in self.metadata.state_dict_metadata.items():
                for chunk in getattr(entry, "chunks", ()):
                    self._chunks[(fqn, tuple(chunk.offsets))] = (tuple(chunk.sizes), entry.properties.dtype)
        return self._chunks.get((index.fqn, tuple(index.offset or ())))

    def _plan_item(self, item, info):
        """``(start, length, how)`` of what to read of ``item``: ``how`` is ``("raw", sizes, dtype)`` (only the rows
        the plan asks for) or ``("whole",)``."""
        if item.type != LoadItemType.BYTE_IO:
            start, chunk = self.layout.get(layout_key(item.storage_index)), self._chunk_sizes(item.storage_index)
            if start is not None and chunk is not None:
                sizes, dtype = chunk
                if not sizes:  # a 0-d tensor
                    return info.offset + start, dtype.itemsize, ("raw", sizes, dtype)
                row = dtype.itemsize
                for size in sizes[1:]:
                    row *= size
                first, rows = item.storage_offsets[0], item.lengths[0]
                return info.offset + start + first * row, rows * row, ("raw", sizes, dtype)
        return info.offset, info.length, ("whole",)

    def read_data(self, plan, planner):
        """Load the plan's items, asking the source once per file for their ranges; returns a done future."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            info = self.metadata.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"DCP item {item.storage_index.fqn!r} expected as plain torch.save bytes; got "
                                      f"one written with stream transforms {list(info.transform_descriptors)}, "
                                      f"which this reader does not decode")
            per_file.setdefault(info.relative_path, []).append((item, *self._plan_item(item, info)))
        for relative_path, items in per_file.items():
            items.sort(key=lambda entry: entry[1])
            pieces = self.source.read(relative_path, [(start, length) for _, start, length, _ in items])
            self.stats["files"] += 1
            for (item, start, length, how), piece in zip(items, pieces):
                piece = memoryview(piece)
                piece = piece.cast("B") if piece.format != "B" or piece.ndim != 1 else piece
                if piece.nbytes != length:
                    raise CheckpointError(f"DCP file {relative_path!r} expected to hold item "
                                          f"{item.storage_index.fqn!r} at bytes {start}..{start + length}; got a "
                                          f"file of {start + piece.nbytes} bytes (truncated or another "
                                          f"checkpoint's)")
                self.stats["read"] += length
                self._load_item(item, piece, how, planner)
            del pieces
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _load_item(self, item, view, how, planner):
        if item.type == LoadItemType.BYTE_IO:
            if self.weights_only:
                try:
                    torch.load(cast(IO[bytes], ViewFile(view)), weights_only=True)  # torch's stub asks for IO[bytes]
                except pickle.UnpicklingError as err:
                    raise CheckpointError(f"DCP item {item.storage_index.fqn!r} holds objects that a safe load "
                                          f"(weights_only=True) refuses; if you trust the checkpoint, load it with "
                                          f"weights_only=False. Detail: {str(err).splitlines()[0]}") from err
            self.stats["needed"] += view.nbytes
            planner.load_bytes(item, io.BytesIO(view))
            return
        if how[0] == "raw":
            _, sizes, dtype = how
            with warnings.catch_warnings():  # a read-only buffer: only copied from
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                rows = torch.frombuffer(view, dtype=dtype) if view.nbytes else torch.empty(0, dtype=dtype)
            tensor = rows.view(item.lengths[0], *sizes[1:]) if sizes else rows.view(())
            tensor = _narrow(tensor, (0, *item.storage_offsets[1:]), item.lengths) if sizes else tensor
        else:
            tensor = _narrow(torch.load(cast(IO[bytes], ViewFile(view)), map_location="cpu", weights_only=True),
                             item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"DCP item {item.storage_index.fqn!r} expected of size {tuple(target.size())} "
                                  f"(this rank's part of the state dict); got {tuple(tensor.size())}")
        self.stats["needed"] += target.numel() * target.element_size()
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        """A checkpoint id names no storage here: the bytes come from the source."""
        return False
