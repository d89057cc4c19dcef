"""DCP's checkpoint format in memory: one rank's file as one blob, and a reader that loads blobs at any world size.

Layer 2 (torch only: no Ray, no files). A ``torch.distributed.checkpoint`` (DCP) StorageWriter and StorageReader
whose storage is memory: :class:`BlobWriter` writes each rank's items into one preallocated buffer laid out exactly
as DCP's own ``FileSystemWriter`` writes ``__{rank}_0.distcp`` (one file per rank, the default), and the
coordinator also gets the checkpoint's ``Metadata``; :class:`BlobReader` loads the items a rank's plan needs from
buffers that a ``fetch(relative_path)`` callable hands it, lazily, one file at a time. A folder holding the blobs
under their names and the metadata as ``.metadata`` is a DCP checkpoint that ``FileSystemReader`` loads, and
:class:`BlobReader` loads what ``FileSystemWriter`` wrote.

The layout of one rank's file (``FileSystemWriter``'s, with ``SerializationFormat.TORCH_SAVE`` and no extensions):
first the rank's byte items (non-tensor values: ``torch.save`` bytes, as the planner resolved them), then each
tensor item as a complete ``torch.save`` archive of the tensor (its local shard; a view is cloned first so that
only its own bytes are written), back to back, no header, no padding, no trailer. The metadata maps each item's
``MetadataIndex`` to ``(relative_path, offset, length)`` (DCP's ``_StorageInfo``); it is pickled (``.metadata``).

Example:
    >>> # dcp.save(state_dict, storage_writer=(writer := BlobWriter())): writer.file_name, writer.blob, writer.metadata
    >>> # dcp.load(state_dict, storage_reader=BlobReader(writer.metadata, {writer.file_name: writer.blob}.__getitem__))
    >>> FILE_NAME.format(rank=1), METADATA_FILE
    ('__1_0.distcp', '.metadata')
"""
import dataclasses
import io
import logging
import pickle
import pathlib
import uuid

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from raysgd.torch.errors import CheckpointError

logger = logging.getLogger(__name__)

#: The file a rank writes and the metadata's, as ``FileSystemWriter`` names them (one file per rank).
FILE_NAME, METADATA_FILE = "__{rank}_0.distcp", ".metadata"
#: What one tensor's ``torch.save`` archive takes beyond the tensor's bytes, at most (measured: 1.5-1.6 KB; the
#: zip records, the pickle of the shape and 64-byte alignment; zip64 adds < 100 bytes). A bound, not the size:
#: the buffer is sized with it and trimmed to what was written.
TORCH_SAVE_OVERHEAD = 4096


def storage_info(relative_path, offset, length):
    """Where an item lies, as DCP's own record (``_StorageInfo``): raysgd's one use of a DCP-internal class, since
    ``FileSystemReader`` needs its type in the metadata. Readers here only read its fields (``relative_path``,
    ``offset``, ``length``, ``transform_descriptors``)."""
    return dcp_filesystem._StorageInfo(relative_path, offset, length)  # noqa: SLF001 (see the docstring)


# ----------------------------------------------------------------- metadata as bytes
_SAFE_GLOBALS = {("torch.distributed.checkpoint.metadata", name)  # its dataclasses and the memory format's enum
                 for name in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")}
_SAFE_GLOBALS |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                  ("torch.serialization", "_get_layout")}  # a layout by its name
_SAFE_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}  # FileSystemWriter's checkpoint_id


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths."""

    def find_class(self, module, name):
        value = None
        if (module, name) in _SAFE_GLOBALS:
            value = super().find_class(module, name)
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            value = getattr(torch, name)
        elif module == "pathlib" and name in _SAFE_PATHS:
            value = getattr(pathlib, name)
        elif module == "collections" and name == "OrderedDict":
            value = super().find_class(module, name)
        if value is None:
            raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not part of DCP's metadata")
        return value


def metadata_to_bytes(metadata):
    """A DCP ``Metadata`` as the bytes of a ``.metadata`` file (a pickle, as ``FileSystemWriter`` writes it)."""
    return pickle.dumps(metadata)


def metadata_from_bytes(data, weights_only=True):
    """The DCP ``Metadata`` in ``data`` (the bytes of a ``.metadata`` file). ``weights_only`` (the default) unpickles
    DCP's metadata classes only, so bytes of unknown origin cannot run code; ``False`` trusts them (as DCP does).

    Example:
        >>> metadata_from_bytes(metadata_to_bytes(dcp_metadata.Metadata({}))).state_dict_metadata
        {}
        >>> import os
        >>> metadata_from_bytes(pickle.dumps(os.getcwd))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        raysgd.torch.errors.CheckpointError: DCP metadata expected (a pickled Metadata); got ... posix.getcwd, ...
    """
    try:
        if weights_only:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        else:
            metadata = pickle.loads(data)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"DCP metadata expected (a pickled Metadata); got bytes that a safe load refuses: "
                              f"{err}") from err
    except Exception as err:  # noqa: BLE001 (truncated or foreign bytes fail in many ways)
        raise CheckpointError(f"DCP metadata expected (a pickled Metadata); got {len(data)} bytes that do not "
                              f"unpickle: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"DCP metadata expected (a pickled Metadata); got a pickled {type(metadata).__name__}")
    return metadata


def as_metadata(metadata, weights_only=True):
    """``metadata`` as a DCP ``Metadata``: the object itself, or read from its bytes (:func:`metadata_from_bytes`)."""
    if isinstance(metadata, dcp_metadata.Metadata):
        return metadata
    if isinstance(metadata, (bytes, bytearray, memoryview)):
        return metadata_from_bytes(metadata, weights_only=weights_only)
    raise TypeError(f"DCP metadata expected as a Metadata or its bytes; got {type(metadata).__name__}")


def file_sizes(metadata):
    """``{relative_path: size in bytes}`` of every file ``metadata`` (a ``Metadata`` or its bytes) refers to, sorted
    by name. A file's size is where its last item ends (DCP's files have no trailer).

    Example:
        >>> md = dcp_metadata.Metadata({}, storage_data={"a": storage_info("__1_0.distcp", 0, 5),
        ...                                             "b": storage_info("__0_0.distcp", 7, 3)})
        >>> file_sizes(md)
        {'__0_0.distcp': 10, '__1_0.distcp': 5}
    """
    sizes = {}
    for info in (as_metadata(metadata).storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return dict(sorted(sizes.items()))


# ----------------------------------------------------------------- writing
class _BlobStream:
    """A write-only file over one preallocated buffer (what ``torch.save`` writes a tensor's archive into)."""

    def __init__(self, capacity):
        self.buffer = bytearray(capacity)
        self._view = memoryview(self.buffer)
        self.position = 0

    def write(self, data):
        data = memoryview(data)
        if data.format != "B" or data.ndim != 1:
            data = data.cast("B")
        end = self.position + data.nbytes
        if end > len(self.buffer):  # never expected: the capacity bounds what the plan writes
            logger.warning("A DCP blob outgrew its %d-byte buffer (%d bytes); growing it (one copy)",
                           len(self.buffer), end)
            self._view.release()
            self.buffer.extend(bytes(max(end - len(self.buffer), len(self.buffer) // 8)))
            self._view = memoryview(self.buffer)
        self._view[self.position:end] = data
        self.position = end
        return data.nbytes

    def flush(self):
        """Nothing to flush: the bytes are in the buffer."""

    def finish(self):
        """The buffer trimmed to what was written (in place: a shrink by less than half does not copy)."""
        self._view.release()
        del self.buffer[self.position:]
        return self.buffer


class BlobWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes each rank's items into one buffer (see the module docstring).

    After ``torch.distributed.checkpoint.save(state_dict, storage_writer=writer)``: :attr:`rank` (this rank in the
    group), :attr:`file_name` (``__{rank}_0.distcp``), :attr:`blob` (a ``bytearray``: the file's bytes) and, on the
    coordinator (rank 0), :attr:`metadata` (the ``.metadata`` file's bytes; None elsewhere). The buffer is sized from
    the rank's write plan before anything is written: the peak is the blob plus the rank's small byte items plus one
    tensor being copied (a view or a device tensor), never a second copy of the blob.

    Example:
        >>> # writer = BlobWriter(); dcp.save(state_dict, storage_writer=writer); writer.blob, writer.metadata
        >>> BlobWriter().blob is None
        True
    """

    def __init__(self):
        super().__init__()
        self.rank, self.file_name, self.blob, self.metadata = 0, None, None, None
        self.save_id = str(uuid.uuid4())

    def reset(self, checkpoint_id=None):
        """A new save starts: forget the last one's results."""
        self.file_name, self.blob, self.metadata = None, None, None
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        """Learn this rank (``rank`` in DCP's keyword arguments; 0 without a process group)."""
        self.rank = kwargs.get("rank") or 0

    def storage_meta(self):
        """The save's id, as ``FileSystemWriter`` records it (no checkpoint path: the storage is memory)."""
        return dcp_metadata.StorageMeta(checkpoint_id=None, save_id=self.save_id)

    def prepare_local_plan(self, plan):
        """The planner's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans):
        """Name each rank's file after its rank (the coordinator sees every plan, in rank order)."""
        return [dataclasses.replace(plan, storage_data=FILE_NAME.format(rank=rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan, planner):
        """Write the plan's byte items, then its tensors, into one buffer sized from the plan; returns a done future
        with one ``WriteResult`` per item."""
        self.file_name = plan.storage_data
        byte_items = [(item, planner.resolve_data(item)) for item in plan.items if item.type == WriteItemType.BYTE_IO]
        tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        capacity = sum(data.getbuffer().nbytes for _, data in byte_items)
        capacity += sum(item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
                        + TORCH_SAVE_OVERHEAD for item in tensor_items)
        stream, results = _BlobStream(capacity), []
        for item, data in byte_items:
            offset = stream.position
            stream.write(data.getbuffer())
            results.append(self._result(item, offset, stream.position - offset))
        del byte_items
        for item in tensor_items:
            tensor = planner.resolve_data(item).detach()
            if tensor.device.type != "cpu":
                tensor = tensor.to("cpu")
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()  # a view: torch.save would write its whole storage
            offset = stream.position
            torch.save(tensor, stream)
            results.append(self._result(item, offset, stream.position - offset))
        self.blob = stream.finish()
        logger.debug("DCP blob %s: %d items, %.2f MB (buffer sized %.2f MB)", self.file_name, len(results),
                     len(self.blob) / 1e6, capacity / 1e6)
        future = Future()
        future.set_result(results)
        return future

    def _result(self, item, offset, length):
        return WriteResult(index=item.index, size_in_bytes=length,
                           storage_data=storage_info(self.file_name, offset, length))

    def finish(self, metadata, results):
        """On the coordinator: record where every item lies and keep the metadata's bytes (:attr:`metadata`)."""
        metadata.version = dcp_filesystem.CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        self.metadata = metadata_to_bytes(metadata)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        """A checkpoint id names no storage here: the blobs are memory."""
        return False


# ----------------------------------------------------------------- reading
class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a buffer, without copying it (what ``torch.load`` reads an item from)."""

    def __init__(self, view):
        super().__init__()
        self._view, self._position = view, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._position

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, target):
        chunk = self._view[self._position:self._position + len(memoryview(target).cast("B"))]
        memoryview(target).cast("B")[:len(chunk)] = chunk
        self._position += len(chunk)
        return len(chunk)


def _narrow(tensor, offsets, lengths):
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class BlobReader(StorageReader):
    """A DCP ``StorageReader`` over buffers: ``fetch(relative_path)`` returns a file's bytes (any bytes-like object).

    ``fetch`` is called in ``read_data`` only, once for each file this rank's load plan needs (never for another),
    and the buffer is dropped once that file's items are loaded: a rank holds one file at a time. Byte items (the
    non-tensor values) are checked with a safe load (``weights_only=True``) before DCP's planner unpickles them,
    unless ``weights_only=False``.

    Args:
        metadata: the checkpoint's ``Metadata`` or its bytes (read safely unless ``weights_only=False``).
        fetch: ``fetch(relative_path) -> buffer``.
        weights_only: load byte items and the metadata only if a safe load accepts them.

    Example:
        >>> # dcp.load(state_dict, storage_reader=BlobReader(metadata_bytes, {"__0_0.distcp": blob}.__getitem__))
        >>> BlobReader(metadata_to_bytes(dcp_metadata.Metadata({})), fetch=None).read_metadata().state_dict_metadata
        {}
    """

    def __init__(self, metadata, fetch, weights_only=True):
        super().__init__()
        self.metadata = as_metadata(metadata, weights_only=weights_only)
        self.fetch, self.weights_only = fetch, weights_only

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

    def read_data(self, plan, planner):
        """Load the plan's items, fetching each file it needs once; returns a done future."""
        per_file = {}
        for item in plan.items:
            info = self.metadata.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"DCP item {item.storage_index.fqn!r} expected as plain torch.save bytes; got "
                                      f"one written with stream transforms {list(info.transform_descriptors)}, "
                                      f"which this reader does not decode")
            per_file.setdefault(info.relative_path, []).append((item, info))
        for relative_path, items in per_file.items():
            data = memoryview(self.fetch(relative_path))
            data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
            for item, info in items:
                end = info.offset + info.length
                if end > data.nbytes:
                    raise CheckpointError(f"DCP file {relative_path!r} expected to hold item {item.storage_index.fqn!r} "
                                          f"at bytes {info.offset}..{end}; got a file of {data.nbytes} bytes "
                                          f"(truncated or another checkpoint's)")
                self._load_item(item, data[info.offset:end], planner)
            del data
        future = Future()
        future.set_result(None)
        return future

    def _load_item(self, item, view, planner):
        if item.type == LoadItemType.BYTE_IO:
            if self.weights_only:
                try:
                    torch.load(_ViewFile(view), weights_only=True)
                except pickle.UnpicklingError as err:
                    raise CheckpointError(f"DCP item {item.storage_index.fqn!r} holds objects that a safe load "
                                          f"(weights_only=True) refuses; if you trust the checkpoint, load it with "
                                          f"weights_only=False. Detail: {str(err).splitlines()[0]}") from err
            planner.load_bytes(item, io.BytesIO(view))
            return
        tensor = _narrow(torch.load(_ViewFile(view), map_location="cpu", weights_only=True),
                         item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"DCP item {item.storage_index.fqn!r} expected of size {tuple(target.size())} "
                                  f"(this rank's part of the state dict); got {tuple(tensor.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        """A checkpoint id names no storage here: the buffers come from ``fetch``."""
        return False
