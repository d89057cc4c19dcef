"""Sharded checkpoints as DCP checkpoint folders on any filesystem pyarrow opens: each rank writes its own file, rank 0
the metadata last; any number of ranks loads them back, each reading only the files its new shard needs.

Layer 4 (torch, pyarrow through :mod:`~raysgd.torch.storage.filesystem`). The folder is what DCP's own
``FileSystemWriter`` writes (``__{rank}_0.distcp`` per rank and ``.metadata``), so ``torch.distributed.checkpoint``
loads a local one as it is, and :func:`load` loads one that ``FileSystemWriter`` wrote. A folder counts once its
``.metadata`` exists: it is written after every rank's file is durable (a local file is written to a temporary
name, ``fsync``ed and renamed; an object store's file is one PUT), so a crash mid-save leaves a folder DCP refuses,
never a mix. Works for a local or NFS folder and for ``s3://``, ``gs://``, ``hdfs://`` URIs (see
:func:`~raysgd.torch.storage.filesystem.resolve`).

Example:
    >>> import tempfile, torch
    >>> folder = tempfile.mkdtemp()
    >>> _ = save({"w": torch.arange(3.0)}, folder)
    >>> sorted(os.listdir(folder))
    ['.metadata', '__0_0.distcp']
    >>> state = {"w": torch.zeros(3)}
    >>> _ = load(state, folder)
    >>> state["w"].tolist(), consolidate(folder)["w"].tolist()
    ([0.0, 1.0, 2.0], [0.0, 1.0, 2.0])
"""
import logging
import os
import uuid

import torch.distributed as dist

from raysgd.base.checks import expect
from raysgd.base.durable_files import fsync_directory
from raysgd.torch.errors import CheckpointError
from raysgd.torch.state import sharded
from raysgd.torch.state.dcp_blobs import METADATA_FILE
from raysgd.torch.storage import filesystem

logger = logging.getLogger(__name__)


def write_file(fs, path, data):
    """Write ``data`` to ``path``: on a local disk through a temporary name, ``fsync``ed, renamed and its folder
    ``fsync``ed (a reader sees the old file or the new one, never a part of it); elsewhere in one PUT (atomic).
    Returns ``(size, crc32)``."""
    if not isinstance(fs, filesystem.pafs.LocalFileSystem):
        return filesystem.write_state_file(fs, path, data)
    temporary = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        written = filesystem.write_state_file(fs, temporary, data)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    fsync_directory(os.path.dirname(path))
    return written


def write_part(storage_path, part):
    """Write one rank's :class:`~raysgd.torch.state.sharded.Part` blob into the folder ``storage_path`` (created if
    needed) under its file name; returns ``(size, crc32)``. Not its metadata: see :func:`write_metadata`.

    Example:
        >>> import tempfile
        >>> write_part(tempfile.mkdtemp(), sharded.Part(0, "__0_0.distcp", bytearray(b"abc")))
        (3, 891568578)
    """
    fs, folder = filesystem.resolve(storage_path)
    fs.create_dir(folder, recursive=True)
    return write_file(fs, f"{folder}/{part.file_name}", part.blob)


def write_metadata(storage_path, metadata):
    """Write a checkpoint's metadata (rank 0's :attr:`~raysgd.torch.state.sharded.Part.metadata` bytes) as
    ``.metadata`` into ``storage_path``: last, once every rank's file is written, since it makes the folder count.

    Example:
        >>> import tempfile
        >>> part = sharded.save_parts({"x": 1})
        >>> folder = tempfile.mkdtemp()
        >>> _ = write_part(folder, part); write_metadata(folder, part.metadata)
        >>> consolidate(folder)
        {'x': 1}
    """
    expect(isinstance(metadata, (bytes, bytearray, memoryview)), "write_metadata",
           "the metadata's bytes (rank 0's Part.metadata)", metadata, TypeError, got=type(metadata).__name__)
    fs, folder = filesystem.resolve(storage_path)
    fs.create_dir(folder, recursive=True)
    write_file(fs, f"{folder}/{METADATA_FILE}", metadata)
    if isinstance(fs, filesystem.pafs.LocalFileSystem):
        fsync_directory(os.path.dirname(folder))  # the folder's own entry


def _gather_errors(error, process_group):
    """Every rank's error text (None where it succeeded), in rank order: a collective of ``process_group``."""
    if not (dist.is_available() and dist.is_initialized()):
        return [error]
    errors = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(errors, error, group=process_group)
    return errors


def save(state_dict, storage_path, process_group=None):
    """Save ``state_dict`` as a DCP checkpoint folder at ``storage_path``: a collective of ``process_group`` (the
    default group; none: this process alone). Each rank writes its own file; once every rank has, rank 0 writes the
    metadata. Returns this rank's :class:`~raysgd.torch.state.sharded.Part`. A failed write on any rank raises on
    every rank (a :class:`~raysgd.torch.errors.CheckpointError` naming the ranks) and no metadata is written. The
    deadline of the collectives is the process group's timeout.

    Example:
        >>> import tempfile, torch
        >>> save({"w": torch.ones(2)}, tempfile.mkdtemp()).file_name
        '__0_0.distcp'
    """
    part = sharded.save_parts(state_dict, process_group=process_group)
    try:
        write_part(storage_path, part)
        error = None
    except Exception as err:  # noqa: BLE001 (told to every rank, which all raise below)
        error = f"rank {part.rank} writing {part.file_name}: {type(err).__name__}: {err}"
    errors = _gather_errors(error, process_group)
    if not any(errors):  # every file is written: rank 0 makes the folder count
        error = None
        if part.metadata is not None:
            try:
                write_metadata(storage_path, part.metadata)
            except Exception as err:  # noqa: BLE001 (told to every rank, which all raise below)
                error = f"rank {part.rank} writing {METADATA_FILE}: {type(err).__name__}: {err}"
        errors = _gather_errors(error, process_group)
    if any(errors):
        raise CheckpointError(f"DCP checkpoint {storage_path!r} expected written by every rank; got: "
                              f"{'; '.join(error for error in errors if error)}")
    return part


def read_file(storage_path, relative_path):
    """The bytes of ``relative_path`` in the folder ``storage_path`` (a pyarrow buffer, read in one request);
    :class:`~raysgd.torch.errors.CheckpointError` when it is missing.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = write_part(folder, sharded.Part(0, "f", bytearray(b"abc")))
        >>> bytes(read_file(folder, "f"))
        b'abc'
    """
    fs, folder = filesystem.resolve(storage_path)
    try:
        with fs.open_input_file(f"{folder}/{relative_path}") as handle:
            return handle.read_buffer()
    except FileNotFoundError as err:
        raise CheckpointError(f"DCP checkpoint {storage_path!r} expected to hold {relative_path!r}; it does not "
                              f"(an incomplete or damaged checkpoint)") from err


#: Ranges of one file closer than this are read in one request (fewer requests to an object store), when the gap
#: is also at most :data:`MERGE_SHARE` of the bytes they join: what is read beyond the ranges stays within it.
MERGE_GAP, MERGE_SHARE = 64 * 1024, 0.05


class FileRanges:
    """A source of byte ranges (``read(relative_path, ranges)``, see
    :class:`~raysgd.torch.state.dcp_reader.BlobReader`) over the files of the folder ``storage_path`` (local or a URI;
    ``folder``: a folder of that filesystem instead, as ``resolve`` names it): each file opened once, only the
    ranges read (ranges nearer than :data:`MERGE_GAP`, a small share of them, in one request). ``sizes`` (``{file:
    bytes}``, a marker's) are checked first: a file of another size is a damaged checkpoint
    (:class:`~raysgd.torch.errors.CheckpointError`), never read. :attr:`pulled` counts the bytes read.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = write_part(folder, sharded.Part(0, "f", bytearray(b"abcdef")))
        >>> source = FileRanges(folder, sizes={"f": 6})
        >>> [bytes(piece) for piece in source.read("f", [(1, 2), (4, 2)])], source.pulled
        ([b'bc', b'ef'], 4)
    """

    def __init__(self, storage_path, sizes=None, folder=None):
        self.storage_path, self.sizes, self.folder, self.pulled = storage_path, dict(sizes or {}), folder, 0

    def read(self, relative_path, ranges):
        fs, folder = filesystem.resolve(self.storage_path)
        folder = self.folder or folder
        try:
            with fs.open_input_file(f"{folder}/{relative_path}") as handle:
                size = handle.size()
                expected = self.sizes.get(relative_path)
                if expected is not None and size != expected:
                    raise CheckpointError(f"DCP checkpoint {self.storage_path!r}: its file {relative_path} has "
                                          f"{size} bytes, the marker says {expected} (damaged)")
                pieces: list[memoryview | None] = [None] * len(ranges)
                for start, end, members in _merged(ranges):
                    data = memoryview(handle.read_at(max(0, min(end, size) - start), start)) if start < size \
                        else memoryview(b"")
                    self.pulled += data.nbytes
                    for index, (offset, length) in members:
                        pieces[index] = data[offset - start:offset - start + length]
                return pieces
        except FileNotFoundError as err:
            raise CheckpointError(f"DCP checkpoint {self.storage_path!r} expected to hold {relative_path!r}; it does "
                                  f"not (an incomplete or damaged checkpoint)") from err


def _merged(ranges):
    """``[(start, end, [(index, (offset, length)), ...])]``: ``ranges`` sorted and merged where the gap between them
    is at most :data:`MERGE_GAP` and :data:`MERGE_SHARE` of the bytes joined."""
    merged: list[list] = []
    for index, (offset, length) in sorted(enumerate(ranges), key=lambda entry: entry[1][0]):
        gap = offset - merged[-1][1] if merged else 0  # (0 unread: nothing to merge into yet)
        if merged and gap <= MERGE_GAP and gap <= MERGE_SHARE * (merged[-1][1] - merged[-1][0] + length):
            merged[-1][1] = max(merged[-1][1], offset + length)
            merged[-1][2].append((index, (offset, length)))
        else:
            merged.append([offset, offset + length, [(index, (offset, length))]])
    return merged


def read_metadata(storage_path):
    """The ``.metadata`` bytes of the checkpoint folder ``storage_path``; :class:`~raysgd.torch.errors.CheckpointError`
    when there is none (not a DCP checkpoint, or one whose save did not finish)."""
    return read_file(storage_path, METADATA_FILE).to_pybytes()


def load(state_dict, storage_path, process_group=None, weights_only=True):
    """Load the DCP checkpoint folder ``storage_path`` into ``state_dict`` in place: a collective of
    ``process_group`` at any world size (see :func:`~raysgd.torch.state.sharded.load_parts`). Each rank reads the
    metadata and then, of the files its own shard needs, only the items it loads (ranged reads: a folder
    ``FileSystemWriter`` wrote has no layout, so an item overlapping the shard is read whole). Returns the counts
    of :func:`~raysgd.torch.state.sharded.load_parts`.

    Example:
        >>> # load(sharded.models_and_optimizers_state(models, optimizers), "s3://bucket/run/step_100")
    """
    metadata = read_metadata(storage_path)
    return sharded.load_parts(state_dict, metadata, FileRanges(storage_path), process_group=process_group,
                              weights_only=weights_only)


def consolidate(storage_path, weights_only=True):
    """The DCP checkpoint folder ``storage_path`` as one state dict of full CPU tensors, nested as it was saved,
    read in this process alone (see :func:`~raysgd.torch.state.sharded.consolidate_parts`): for serving or a model's
    copy. Example: see the module docstring."""
    metadata = read_metadata(storage_path)
    return sharded.consolidate_parts(metadata, lambda name: read_file(storage_path, name), weights_only=weights_only)
