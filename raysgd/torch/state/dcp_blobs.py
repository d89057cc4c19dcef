"""DCP's checkpoint format in memory: each rank's file written as one blob by DCP's own ``FileSystemWriter``, with
the *layout* that lets a load read only the rows it needs (:mod:`~raysgd.torch.state.dcp_reader` reads them).

Layer 2 (torch only: no Ray, no files). :class:`BlobWriter` *is* ``torch.distributed.checkpoint``'s (DCP)
``FileSystemWriter`` (one file per rank, ``torch.save`` items), given an in-memory ``FileSystemBase`` (the storage
interface ``FileSystemWriter`` writes through; torch's own fsspec writer plugs its storage in the same way). Each
rank's file is therefore byte for byte the ``__{rank}_0.distcp`` that ``FileSystemWriter`` writes, and the
coordinator's ``.metadata`` is DCP's own, records included: nothing of DCP's layout is reproduced here, so a torch
upgrade that changes it changes both sides together. The only addition is the *layout*: for each tensor item, where
its raw bytes start inside the item (``torch.save`` stores a tensor's data uncompressed in a zip record, found
through the zip's central directory right after the item is written). Only a tensor stored row-major has one:
``torch.save`` keeps a tensor's strides, so a channels_last or transposed tensor's bytes are not its rows; such an
item is read whole.

The metadata is read back with a safe unpickler (:func:`metadata_from_bytes`): DCP's metadata classes only, and the
storage record ``FileSystemWriter`` puts in it (``_StorageInfo``, allowed by name: it is never constructed here; a
reader reads its ``relative_path``, ``offset`` and ``length``). A folder holding the blobs under their names and the
metadata as ``.metadata`` is a DCP checkpoint that DCP's ``FileSystemReader`` loads.

Example:
    >>> # dcp.save(state_dict, storage_writer=(writer := BlobWriter())): writer.file_name, writer.blob, writer.metadata
    >>> FILE_NAME.format(rank=1), METADATA_FILE
    ('__1_0.distcp', '.metadata')
"""
import contextlib
import io
import logging
import pickle
import pathlib
import struct
import sys
import zipfile

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raysgd.torch.errors import CheckpointError

logger = logging.getLogger(__name__)

#: The file a rank writes and the metadata's, as ``FileSystemWriter`` names them (one file per rank).
FILE_NAME, METADATA_FILE = "__{rank}_0.distcp", ".metadata"
#: What one tensor's ``torch.save`` archive takes beyond the tensor's bytes, at most (measured: 1.5-1.6 KB; the
#: zip records, the pickle of the shape and 64-byte alignment; zip64 adds < 100 bytes). A bound, not the size:
#: the buffer is sized with it and trimmed to what was written.
TORCH_SAVE_OVERHEAD = 4096
_MEMORY = "raysgd-memory"  # the in-memory folder BlobWriter's FileSystemWriter writes into


# ----------------------------------------------------------------- metadata as bytes
_SAFE_GLOBALS = {("torch.distributed.checkpoint.metadata", name)  # its dataclasses and the memory format's enum
                 for name in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")}
_SAFE_GLOBALS |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # FileSystemWriter's storage record
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
        >>> import torch.distributed.checkpoint as dcp
        >>> writer = BlobWriter()
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
        >>> file_sizes(writer.metadata) == {"__0_0.distcp": len(writer.blob)}
        True
    """
    sizes: dict[str, int] = {}
    for info in (as_metadata(metadata).storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return dict(sorted(sizes.items()))


def renamed_files(metadata, names):
    """``metadata`` (a ``Metadata`` or its bytes) with its files renamed by ``names`` (``{old: new}``; a file not
    in it keeps its name), as bytes: the records are DCP's own, each copied with its ``relative_path`` replaced.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> writer = BlobWriter()
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
        >>> list(file_sizes(renamed_files(writer.metadata, {"__0_0.distcp": "__0_1.distcp"})))
        ['__0_1.distcp']
    """
    import dataclasses  # noqa: PLC0415

    metadata = as_metadata(metadata)
    copy = dataclasses.replace(metadata, storage_data={
        index: dataclasses.replace(info, relative_path=names.get(info.relative_path, info.relative_path))
        for index, info in (metadata.storage_data or {}).items()})
    return metadata_to_bytes(copy)


# ----------------------------------------------------------------- the layout: where a tensor item's bytes start
_EOCD, _CENTRAL, _LOCAL = 0x06054B50, 0x02014B50, 0x04034B50


def raw_data_offset(item, nbytes):
    """Where the tensor's raw bytes start inside ``item`` (one ``torch.save`` archive of a contiguous tensor of
    ``nbytes`` bytes), found through the zip's central directory; None when the archive is not as expected (its
    data record not stored uncompressed, another size, a zip64 directory): such an item is then read whole.

    Example:
        >>> buffer = io.BytesIO(); torch.save(torch.arange(4.0), buffer)
        >>> item = buffer.getbuffer()
        >>> start = raw_data_offset(item, 16)
        >>> torch.frombuffer(bytearray(item[start:start + 16]), dtype=torch.float32).tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    view = memoryview(item).cast("B") if not isinstance(item, memoryview) or item.format != "B" else item
    end = len(view)
    if end < 22 or struct.unpack_from("<I", view, end - 22)[0] != _EOCD:  # torch writes no comment
        return _zipfile_offset(view, nbytes)
    entries, size, start = struct.unpack_from("<HII", view, end - 12)
    if start == 0xFFFFFFFF or size == 0xFFFFFFFF or start + size > end:
        return _zipfile_offset(view, nbytes)
    position = start
    for _ in range(entries):
        if struct.unpack_from("<I", view, position)[0] != _CENTRAL:
            return None
        method, = struct.unpack_from("<H", view, position + 10)
        compressed, uncompressed, name_len, extra_len, comment_len = struct.unpack_from("<IIHHH", view, position + 20)
        local, = struct.unpack_from("<I", view, position + 42)
        name = bytes(view[position + 46:position + 46 + name_len])
        position += 46 + name_len + extra_len + comment_len
        if name.endswith(b"/data/0"):
            if method != 0 or compressed != nbytes or uncompressed != nbytes or local == 0xFFFFFFFF:
                return _zipfile_offset(view, nbytes) if 0xFFFFFFFF in (compressed, local) else None
            return _local_data(view, local, nbytes)
    return None


def _local_data(view, local, nbytes):
    if struct.unpack_from("<I", view, local)[0] != _LOCAL:
        return None
    name_len, extra_len = struct.unpack_from("<HH", view, local + 26)
    start = local + 30 + name_len + extra_len
    return start if start + nbytes <= len(view) else None


def _zipfile_offset(view, nbytes):
    """The same through ``zipfile`` (zip64 archives of tensors over 4 GB)."""
    try:
        with zipfile.ZipFile(ViewFile(view)) as archive:
            for info in archive.infolist():
                if info.filename.endswith("/data/0"):
                    if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
                        return None
                    return _local_data(view, info.header_offset, nbytes)
    except (zipfile.BadZipFile, struct.error, ValueError):
        return None
    return None


def layout_key(index):
    """The key of a stored item (a ``MetadataIndex``) in a layout: its fully qualified name and chunk offset."""
    return f"{index.fqn}@{','.join(map(str, index.offset or ()))}"


# ----------------------------------------------------------------- writing
class _BlobStream:
    """A write-only file over one preallocated buffer (what ``FileSystemWriter`` writes a rank's file into)."""

    def __init__(self, capacity, exact=True):
        self.buffer = bytearray(capacity)
        self._view = memoryview(self.buffer)
        self.position, self._exact = 0, exact

    def write(self, data):
        data = memoryview(data)
        if data.format != "B" or data.ndim != 1:
            data = data.cast("B")
        end = self.position + data.nbytes
        if end > len(self.buffer):
            if self._exact:  # never expected: the capacity bounds what the plan writes
                logger.warning("A DCP blob outgrew its %d-byte buffer (%d bytes); growing it (one copy)",
                               len(self.buffer), end)
            self._view.release()
            self.buffer.extend(bytes(max(end - len(self.buffer), len(self.buffer) // 8)))
            self._view = memoryview(self.buffer)
        self._view[self.position:end] = data
        self.position = end
        return data.nbytes

    def tell(self):
        return self.position

    def writable(self):
        return True

    def flush(self):
        """Nothing to flush: the bytes are in the buffer."""

    def close(self):
        """Nothing to close: :meth:`finish` hands the buffer over."""

    def finish(self):
        """The buffer trimmed to what was written (in place: a shrink by less than half does not copy)."""
        self._view.release()
        del self.buffer[self.position:]
        return self.buffer


class _MemoryFiles(FileSystemBase):
    """DCP's storage interface over memory: the files ``FileSystemWriter`` writes, by name. A file's buffer is sized
    from :attr:`capacity` (``{name or ".distcp": bytes}``: the next data file's under ``".distcp"``) when it is
    given, else grown as it is written (the metadata)."""

    def __init__(self):
        self.files, self.capacity = {}, {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            raise io.UnsupportedOperation(f"an in-memory DCP file is written once; got mode {mode!r}")
        name = str(path).rsplit("/", 1)[-1]
        capacity = self.capacity.pop(".distcp" if name.endswith(".distcp") else name, None)
        stream = _BlobStream(capacity if capacity is not None else 1024, exact=capacity is not None)
        yield stream
        self.files[name] = stream.finish()

    def concat_path(self, path, suffix):
        return f"{path}/{suffix}"

    def rename(self, path, new_path):
        self.files[str(new_path).rsplit("/", 1)[-1]] = self.files.pop(str(path).rsplit("/", 1)[-1])

    def init_path(self, path):
        return str(path)

    def mkdir(self, path):
        """Nothing to make: the files are keys."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return False

    def exists(self, path):
        return str(path).rsplit("/", 1)[-1] in self.files

    def rm_file(self, path):
        self.files.pop(str(path).rsplit("/", 1)[-1], None)


def _item_bytes(item):
    """The bytes of a tensor write item's chunk (this rank's shard, not the whole tensor)."""
    count = 1
    for size in item.tensor_data.chunk.sizes:
        count *= size
    return count * item.tensor_data.properties.dtype.itemsize


class BlobWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` writing each rank's file into one buffer in memory (see the module docstring).

    After ``torch.distributed.checkpoint.save(state_dict, storage_writer=writer)``: :attr:`rank` (this rank in the
    group), :attr:`file_name` (``__{rank}_0.distcp``), :attr:`blob` (a ``bytearray``: the file's bytes) and, on the
    coordinator (rank 0), :attr:`metadata` (the ``.metadata`` file's bytes) and :attr:`layout` (``{item key: where
    its raw bytes start in its file}`` of every rank's tensor items); None elsewhere. The buffer is sized from the
    rank's write plan before anything is written: the peak is the blob plus one tensor being copied (a view or a
    device tensor), never a second copy of the blob.

    Example:
        >>> BlobWriter().blob is None
        True
    """

    fs: _MemoryFiles  # type: ignore[assignment]  # torch types it FileSystem; FileSystemWriter takes any FileSystemBase
    file_name: str | None
    blob: bytearray | None
    metadata: bytes | None
    layout: dict | None

    def __init__(self):
        super().__init__(_MEMORY, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self.fs = _MemoryFiles()  # FileSystemWriter's storage interface (as torch's fsspec writer sets its own)
        self.rank, self.file_name, self.blob, self.metadata, self.layout = 0, None, None, None, None

    def reset(self, checkpoint_id=None):
        """A new save starts: forget the last one's results."""
        super().reset(None)
        self.fs = _MemoryFiles()
        self.file_name, self.blob, self.metadata, self.layout = None, None, None, None

    def write_data(self, plan, planner):
        """``FileSystemWriter``'s write of this rank's file, into a buffer sized from the plan first; each tensor
        item's result also carries where its raw bytes start (taken out again in :meth:`finish`)."""
        capacity = 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                capacity += len(planner.resolve_data(item).getbuffer())  # (resolved again when written: small)
            else:
                capacity += _item_bytes(item) + TORCH_SAVE_OVERHEAD
        self.fs.capacity[".distcp"] = capacity
        results = super().write_data(plan, planner).wait()
        written = [name for name in self.fs.files if name.endswith(".distcp")]  # one: a file per rank
        if len(written) != 1:
            raise CheckpointError(f"DCP's FileSystemWriter expected to write one file per rank; it wrote {written}")
        self.file_name = written[0]  # FileSystemWriter's name: __{rank in the group}_0.distcp
        self.rank = int(self.file_name.split("_")[2])
        self.blob = self.fs.files.pop(self.file_name)
        view = memoryview(self.blob)
        # a tensor whose bytes are not stored row-major (channels_last, a transposed buffer: torch.save keeps its
        # strides) has no layout: its rows are not a byte range, so it is read whole and torch.load puts it back
        tensors = {item.index: item for item in plan.items if item.type != WriteItemType.BYTE_IO
                   and planner.resolve_data(item).is_contiguous()}
        marked = []
        for result in results:
            item, start = tensors.get(result.index), None
            info = result.storage_data
            if item is not None and sys.byteorder == "little" and not getattr(info, "transform_descriptors", None):
                start = raw_data_offset(view[info.offset:info.offset + info.length], _item_bytes(item))
            marked.append(WriteResult(index=result.index, size_in_bytes=result.size_in_bytes,
                                      storage_data=(info, start)))
        view.release()
        logger.debug("DCP blob %s: %d items, %.2f MB (buffer sized %.2f MB)", self.file_name, len(marked),
                     len(self.blob) / 1e6, capacity / 1e6)
        future: Future[list[WriteResult]] = Future()
        future.set_result(marked)
        return future

    def finish(self, metadata, results):
        """On the coordinator: ``FileSystemWriter``'s metadata, kept as bytes (:attr:`metadata`), and the layout of
        every rank's tensor items (:attr:`layout`)."""
        layout: dict[str, int] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([])
            for result in rank_results:
                info, start = result.storage_data
                if start is not None:
                    layout[layout_key(result.index)] = start
                plain[-1].append(WriteResult(index=result.index, size_in_bytes=result.size_in_bytes,
                                             storage_data=info))
        super().finish(metadata, plain)
        self.metadata, self.layout = bytes(self.fs.files.pop(METADATA_FILE)), layout

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        """A checkpoint id names no storage here: the blobs are memory."""
        return False


# ----------------------------------------------------------------- reading
class ViewFile(io.RawIOBase):
    """A read-only, seekable file over a buffer, without copying it (what ``torch.load`` or ``zipfile`` reads an
    item from).

    Example:
        >>> ViewFile(memoryview(b"abc")).read(2)
        b'ab'
    """

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
