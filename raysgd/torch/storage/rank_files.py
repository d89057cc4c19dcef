"""A rank's files in a checkpoint directory: written from the node the rank runs on, read back onto any node.

Layer 4 (ray, and :mod:`~raysgd.torch.storage.filesystem`). A training function reports a local directory on each
rank (``raysgd.train.report(metrics, checkpoint)``); every rank's files land in one checkpoint directory of the run's
folder (:class:`~raysgd.torch.storage.filesystem.CheckpointStorage`), whose marker, written last, lists every file
with its size and CRC-32. No file passes through the driver's process:

- a URI (``s3://``, ``gs://``, ...) or a folder on this node: the rank writes its files itself (:func:`write_files`);
- a local folder of the driver's machine (``storage_path="/data/runs"``) seen from a rank on another node, where that
  folder may not exist: the rank puts its files into its node's object store and a 0-CPU task on the driver's node
  (``home``) writes them there, as :mod:`raysgd.torch.storage.parts` writes a trainer's state. NFS works either way.

:func:`fetch` reads a checkpoint back into a local folder of the calling node the same ways (``get_checkpoint()`` on
a rank of another node than the driver's), and :func:`verify` checks the files against the marker (sizes always;
CRC-32 where reading is local), so a truncated file is found before the training function reads it.

The tasks' functions are sent by value (:func:`~raysgd.torch.restart_points.transport.by_value`) and use the standard
library only: the driver's node starts them without importing torch.

Example:
    >>> import os, tempfile
    >>> source, run = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> _ = open(os.path.join(source, "model.pt"), "wb").write(b"weights")
    >>> local_files(source)
    ['model.pt']
    >>> write_files(run, os.path.join(run, "checkpoint_000001"), source, ["model.pt"], home=None)[0]
    {'model.pt': [7, 449999704]}
"""
import logging
import os
import shutil
import tempfile
import time
import uuid
import zlib

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysgd.base.durable_files import fsync_directory
from raysgd.torch.restart_points import restart_point
from raysgd.torch.restart_points.transport import by_value, out_of_band
from raysgd.torch.storage import filesystem

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes read and written at a time: a file of any size is copied in constant memory


def _local_path(root, name):
    """Where the checkpoint file ``name`` (``/``-separated, as markers list it) lies in the local folder ``root``."""
    return os.path.join(root, *name.split("/"))


def local_files(source, skip=()):
    """The files under the local folder ``source``, as sorted relative POSIX paths, but for the names in ``skip`` at
    its top; ``ValueError`` when it is no folder.

    Example:
        >>> local_files("/no/such/folder")
        Traceback (most recent call last):
        ...
        ValueError: a checkpoint directory must be an existing local folder; got '/no/such/folder'
    """
    if not os.path.isdir(source):
        raise ValueError(f"a checkpoint directory must be an existing local folder; got {source!r}")
    found = []
    for folder, _, files in os.walk(source):
        for name in files:
            found.append(os.path.relpath(os.path.join(folder, name), source).replace(os.sep, "/"))
    return sorted(file for file in found if file not in skip)


def _here(home):
    """Whether a local folder of ``home`` (a node id; None: this one) is reachable from this process."""
    return home is None or home == restart_point.this_node()


def _pump(reader, writer):
    """Copy ``reader`` to ``writer`` in chunks (constant memory); returns ``(size, crc32)`` of what went through."""
    size, crc32 = 0, 0
    while True:
        chunk = reader.read(_CHUNK)
        if not chunk:
            return size, crc32
        crc32 = zlib.crc32(chunk, crc32)
        size += len(chunk)
        writer.write(chunk)


def _copy_local(source, destination):
    """Copy one local file; returns ``(size, crc32)``, the copy ``fsync``ed."""
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    with open(source, "rb") as reader, open(destination, "wb") as writer:
        answer = _pump(reader, writer)
        writer.flush()
        os.fsync(writer.fileno())
    return answer


def _copy_to(fs, source, destination):
    """Copy one local file to ``destination`` of the pyarrow filesystem ``fs`` (one PUT on an object store)."""
    with open(source, "rb") as reader, fs.open_output_stream(destination) as writer:
        return _pump(reader, writer)


def _write_blobs(directory, blobs):
    """On the home node: write ``{name: bytes}`` under the local ``directory``; ``{name: [size, crc32]}``."""
    written = {}
    for name, blob in blobs.items():
        path = _local_path(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = memoryview(blob).cast("B")
        with open(path, "wb") as writer:
            writer.write(data)
            writer.flush()
            os.fsync(writer.fileno())
        written[name] = [data.nbytes, zlib.crc32(data)]
    return written


def _read_blobs(directory, names, optional=()):
    """On the home node: ``{name: bytes}`` of the files ``names`` under the local ``directory``, and of those of
    ``optional`` (names not among ``names``) that it holds."""
    blobs = {}
    for name in [*names, *optional]:
        path = _local_path(directory, name)
        if name not in optional or os.path.isfile(path):
            with open(path, "rb") as reader:
                blobs[name] = reader.read()
    return blobs


def _write_text(path, text):
    """On the home node: write a small file (a marker) and ``fsync`` it, its folder and the folder's parent."""
    os.makedirs(os.path.dirname(path), exist_ok=True)  # the folder of a checkpoint without files is not there yet
    with open(path, "w", encoding="utf-8") as writer:
        writer.write(text)
        writer.flush()
        os.fsync(writer.fileno())
    for folder in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        fsync_directory(folder)  # sent by value with this task (transport.by_value): no import of raysgd there


def _state_of(directory, marker_name):
    """On the home node: ``"complete"``, ``"incomplete"`` (removed now) or ``"absent"`` for a local checkpoint
    directory."""
    if os.path.exists(os.path.join(directory, marker_name)):
        return "complete"
    if os.path.isdir(directory):
        shutil.rmtree(directory, ignore_errors=True)
        return "incomplete"
    return "absent"


_tasks: dict = {}


def _on_home(function, home, *args, timeout_s):
    """Run ``function(*args)`` (sent by value) in a 0-CPU task on the node ``home`` and return its answer."""
    if function not in _tasks:
        _tasks[function] = ray.remote(num_cpus=0, max_retries=0)(by_value(function))
    strategy = NodeAffinitySchedulingStrategy(home, soft=False)  # only that node has the folder
    return ray.get(_tasks[function].options(scheduling_strategy=strategy).remote(*args), timeout=timeout_s)


def write_files(storage_root, directory, source, names, *, home, timeout_s=600):
    """Write the files ``names`` of the local folder ``source`` to the checkpoint ``directory`` (a path inside the
    filesystem of ``storage_root``, a folder or URI); returns ``({name: [size, crc32]}, node)``: what was written, and
    the id of the node that wrote it.

    A URI, or a local folder on ``home`` (the node whose disk the folder is on: the driver's; None: this one) seen
    from that node, is written from this process; a local folder seen from another node goes through a task on
    ``home``, the files through this node's object store (see the module docstring)."""
    started = time.monotonic()
    fs, _ = filesystem.resolve(storage_root)
    node = restart_point.this_node()
    if not isinstance(fs, filesystem.pafs.LocalFileSystem):
        fs.create_dir(directory, recursive=True)
        written = {name: list(_copy_to(fs, _local_path(source, name), f"{directory}/{name}")) for name in names}
    elif _here(home):
        written = {name: list(_copy_local(_local_path(source, name), _local_path(directory, name)))
                   for name in names}
    else:
        node = home
        blobs = {}
        for name in names:
            with open(_local_path(source, name), "rb") as reader:
                blobs[name] = out_of_band(reader.read())
        written = _on_home(_write_blobs, home, directory, blobs, timeout_s=timeout_s)
    logger.debug("%d file(s) written to %s in %.2f s", len(written), directory, time.monotonic() - started)
    return written, node


def prepare_directory(storage_root, directory, marker_name, *, home, timeout_s=60):
    """Before the ranks write a checkpoint's files to ``directory``: remove what a failed attempt left there (no
    marker); ``FileExistsError`` when a complete checkpoint already has that name."""
    fs, _ = filesystem.resolve(storage_root)
    if isinstance(fs, filesystem.pafs.LocalFileSystem) and not _here(home):
        state = _on_home(_state_of, home, directory, marker_name, timeout_s=timeout_s)
    else:
        info = fs.get_file_info(f"{directory}/{marker_name}")
        if info.type == filesystem.pafs.FileType.File:
            state = "complete"
        elif fs.get_file_info(directory).type == filesystem.pafs.FileType.Directory:
            fs.delete_dir(directory)
            state = "incomplete"
        else:
            state = "absent"
    if state == "complete":
        raise FileExistsError(f"a complete checkpoint named {directory.rsplit('/', 1)[-1]!r} already exists in "
                              f"this run: report(checkpoint_dir_name=...) must name a new directory every time")
    if state == "incomplete":
        logger.info("Removed the incomplete checkpoint %s (a failed attempt's)", directory)


def write_marker(storage_root, directory, files, meta, marker_name, *, home, timeout_s=60):
    """Write the marker of the checkpoint ``directory`` (last: see :func:`raysgd.torch.storage.filesystem.write_marker`),
    from this process or, for a local folder of another node, from a task there; returns the marker."""
    fs, _ = filesystem.resolve(storage_root)
    if not isinstance(fs, filesystem.pafs.LocalFileSystem) or _here(home):
        if not files:  # no rank wrote a file (empty folders reported): a local folder is not there yet
            fs.create_dir(directory, recursive=True)
        return filesystem.write_marker(fs, directory, files, meta, name=marker_name)
    marker = {"format": filesystem.FORMAT, **meta, "files": {k: list(v) for k, v in files.items()},
              "time": time.time()}
    _on_home(_write_text, home, os.path.join(directory, marker_name),
             filesystem.marker_text(marker), timeout_s=timeout_s)
    return marker


def verify(fs, directory, marker, crc=None):
    """Check the files the ``marker`` of ``directory`` lists: each present with its size, and (``crc``, by default
    where the filesystem is local) its CRC-32, read in chunks; :class:`~raysgd.torch.storage.filesystem.DamagedCheckpoint`
    naming the first that is not. The checkpoint's metadata
    (:data:`~raysgd.torch.storage.filesystem.CHECKPOINT_METADATA`, which ``set_metadata()`` may rewrite) is checked
    for presence only."""
    files = marker.get("files")
    if not isinstance(files, dict):
        raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r}: its marker lists no files")
    crc = isinstance(fs, filesystem.pafs.LocalFileSystem) if crc is None else crc
    for name, listed in sorted(files.items()):
        if not isinstance(listed, (list, tuple)) or len(listed) != 2:
            raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r}: its marker's entry for {name!r} is "
                                               f"damaged ({listed!r})")
        size, crc32 = listed
        path = f"{directory}/{name}"
        info = fs.get_file_info(path)
        if info.type != filesystem.pafs.FileType.File:
            raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r} lost its file {name}")
        if name == filesystem.CHECKPOINT_METADATA:
            continue
        if info.size != size:
            raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r} is damaged: its file {name} has "
                                               f"{info.size} bytes, the marker says {size}")
        if crc:
            found = 0
            with fs.open_input_stream(path) as reader:
                while True:
                    chunk = reader.read(_CHUNK)
                    if not chunk:
                        break
                    found = zlib.crc32(chunk, found)
            if found != crc32:
                raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r} is damaged: its file {name} has "
                                                   f"CRC-32 {found}, the marker says {crc32}")


def fetch(storage_root, directory, names, destination, *, home, optional=(filesystem.CHECKPOINT_METADATA,),
          timeout_s=600):
    """Copy the files ``names`` of the checkpoint ``directory`` into the local folder ``destination`` of this node
    (from a URI directly; from a local folder of another node through a task there); returns ``destination``.

    The names of ``optional`` are copied too when the checkpoint holds them: by default its metadata
    (:data:`~raysgd.torch.storage.filesystem.CHECKPOINT_METADATA`), which ``set_metadata()`` may first write after
    the report, so the marker need not list it.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> for name in ("model.pt", ".metadata.json"):
        ...     _ = open(os.path.join(folder, name), "w").write("{}")
        >>> sorted(os.listdir(fetch(folder, folder, ["model.pt"], tempfile.mkdtemp(), home=None)))
        ['.metadata.json', 'model.pt']
    """
    fs, _ = filesystem.resolve(storage_root)
    os.makedirs(destination, exist_ok=True)
    extra = [name for name in optional if name not in names]
    if not isinstance(fs, filesystem.pafs.LocalFileSystem):
        held = [name for name in extra
                if fs.get_file_info(f"{directory}/{name}").type == filesystem.pafs.FileType.File]
        for name in [*names, *held]:
            target = _local_path(destination, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with fs.open_input_stream(f"{directory}/{name}") as reader, open(target, "wb") as writer:
                _pump(reader, writer)
    elif _here(home):
        held = [name for name in extra if os.path.isfile(_local_path(directory, name))]
        for name in [*names, *held]:
            target = _local_path(destination, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(_local_path(directory, name), target)
    else:
        blobs = _on_home(_read_blobs, home, directory, list(names), extra, timeout_s=timeout_s)
        for name, blob in blobs.items():
            target = _local_path(destination, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as writer:
                writer.write(blob)
    return destination


def scratch_folder(prefix="raysgd-checkpoint-"):
    """A new local folder for a checkpoint read onto this node (removed by whoever made it)."""
    return tempfile.mkdtemp(prefix=f"{prefix}{uuid.uuid4().hex[:6]}-")
