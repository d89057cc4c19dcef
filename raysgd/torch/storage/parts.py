"""Checkpoint parts written where the state is: a 0-CPU Ray task on the node holding a restart point writes the
state file to ``storage_path``, so a durable checkpoint's bytes never pass through the driver.

Layer 4 (ray, and :mod:`~raysgd.torch.storage.filesystem`). The driver's checkpoint writer
(:class:`~raysgd.torch.storage.durable.DurableRun`, on its background thread) hands a :class:`RemotePart` to
:func:`~raysgd.torch.storage.filesystem.write_checkpoint_dir`, which calls :meth:`RemotePart.write_to`: the task
fetches the first available copy of the state (:func:`raysgd.torch.restart_points.restart_point.first_available`: on the
node holding it this is a read of the local object store), writes it, ``fsync``s a local file and answers
``(size, crc32)``; the driver then writes the small marker, last, as before. The task runs on the node of the
state's first copy for an object store or other URI (``s3://``), and on the driver's node for a local path (a
folder that may exist on the driver's disk only; NFS works either way). A resume reads the other way:
:func:`read_part` checks a checkpoint's state file against its marker in a task on rank 0's node and leaves the
bytes in that node's object store, where every worker loads them from.

This module imports no torch (nor does :mod:`~raysgd.torch.storage.filesystem`): the write and read tasks' processes
import it by name, and a process that imports torch costs about a CPU second more and ~150 MB. Only a commit's
overlay and a sharded state's head need torch, which those code paths import where they run.

A sharded state's checkpoint (FSDP) is written by :class:`ShardedRemoteParts` (a task per rank's part, then the
head, DCP's ``.metadata`` and the marker; over an existing one in the other set of names, atomically) and read back
by the workers themselves (:class:`ShardedFiles`: each reads its byte ranges of the parts; the driver reads only the
marker and the head).

Example:
    >>> # part = RemotePart(point.refs, point.nodes[0], storage.root, storage.local, timeout_s=600)
    >>> # write_checkpoint_dir(fs, directory, part, meta) -> the marker, with the size and CRC the task measured
"""
import logging
import os
import re
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysgd.base.paths import expand_path, is_uri
from raysgd.torch.restart_points import restart_point
from raysgd.torch.storage import filesystem

logger = logging.getLogger(__name__)

#: DCP's metadata file of a sharded checkpoint (the folder then loads with DCP's own ``FileSystemReader`` too).
DCP_METADATA = ".metadata"


def _dcp_files():
    """:mod:`raysgd.torch.storage.dcp_files`, imported at first use: it brings torch's DCP (with DTensor and sympy,
    ~0.65 s of a process start), which only sharded strategies need; the driver and DDP workers never import it."""
    from raysgd.torch.storage import dcp_files  # noqa: PLC0415

    return dcp_files


def _write(refs, root, path, timeout_s, overlay=None):
    """On the holder's node: write the first available copy of ``refs`` (updated with ``overlay``, a commit's
    per-rank records) to ``path`` under ``root``."""
    fs, _ = filesystem.resolve(root)
    stream = restart_point.first_available(refs, timeout_s)
    if overlay:  # only a commit's state needs torch here: a task's process imports it for that alone
        from raysgd.torch.state import checkpoint  # noqa: PLC0415

        stream = checkpoint.state_to_bytes({**checkpoint.state_from_bytes(stream), **overlay})
    return filesystem.write_state_file(fs, path, stream)


_write_task = None


class RemotePart:
    """The state file of a checkpoint, written by a task on the node holding the state (see the module docstring).

    Args:
        refs: the restart point's refs (the same bytes on different nodes, the preferred first).
        node: the node of the first copy (None: anywhere).
        root: ``storage_path`` as :func:`~raysgd.torch.storage.filesystem.resolve` takes it on any node.
        local: whether ``root`` is a local folder (then the task runs on this process's node).
        timeout_s: the deadline of the whole write.
        overlay: what the state is updated with before it is written (a commit's per-rank records), or None.

    Example:
        >>> RemotePart([], None, "/tmp/run", local=True, timeout_s=5).timeout_s
        5
    """

    def __init__(self, refs, node, root, local, timeout_s=600, overlay=None):
        self.refs, self.root, self.timeout_s, self.overlay = list(refs), root, timeout_s, overlay
        self.node = restart_point.this_node() if local else node

    def start(self, directory, name):
        """Start the task writing ``directory/name``; returns its ref (answering ``(size, crc32)``)."""
        global _write_task
        if _write_task is None:
            _write_task = ray.remote(num_cpus=0, max_retries=0)(_write)
        options = {} if self.node is None else {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(self.node, soft=True)}  # elsewhere if it is gone
        return _write_task.options(**options).remote(self.refs, self.root, f"{directory}/{name}", self.timeout_s,
                                                     self.overlay)

    def write_to(self, directory, name):
        """Write the state as ``directory/name`` (a task on :attr:`node`); returns ``(size, crc32)``. A failed or
        overdue write raises (the checkpoint then has no marker and does not count)."""
        started = time.monotonic()
        size, crc32 = ray.get(self.start(directory, name), timeout=self.timeout_s)
        logger.debug("state part %s/%s written on node %s (%.1f MB, %.2f s)", directory, name,
                     (self.node or "?")[:12], size / 1e6, time.monotonic() - started)
        return size, crc32


class ShardedRemoteParts:
    """The files of a sharded state's checkpoint (a :class:`~raysgd.torch.restart_points.restart_point.ShardedPoint`): each
    rank's part written by a task on the node holding it (in parallel), then, from this process, the small head
    (the rest of the state, updated with the overlay, the DCP metadata and the layout) as the state file and the DCP
    ``.metadata``: the folder is a DCP checkpoint of the models and optimizers too. The marker lists every part's
    size and CRC-32.

    Saved over an existing checkpoint (``save(path)`` every epoch), nothing the old marker names is touched: the new
    files take the other of two sets of names (``__{rank}_1.distcp`` and ``trainer.1.checkpoint`` after
    ``__{rank}_0.distcp`` and ``trainer.checkpoint``: both are DCP's and raysgd's names, the DCP metadata records
    which), the marker (replaced in one rename, or one PUT) switches to them, and only then are the old ones deleted
    (:meth:`after_marker`). A process killed at any point leaves a loadable checkpoint: the old one until the new
    marker exists, the new one after. DCP's ``.metadata`` (for DCP's own readers) is replaced in one rename too,
    before the marker.

    Example:
        >>> ShardedRemoteParts(None, "/tmp/run", local=True, timeout_s=5).timeout_s
        5
    """

    def __init__(self, point, root, local, timeout_s=600):
        self.point, self.root, self.local, self.timeout_s = point, root, local, timeout_s

    def write_to(self, directory, name):
        """Write every file into ``directory`` (the head under the state file name of the new set); returns ``(size,
        crc32, {"parts": {file: [size, crc32]}, "file": head, "generation": 0 or 1})`` for the marker. A failed or
        overdue write raises (no marker: the checkpoint does not count)."""
        fs, _ = filesystem.resolve(self.root)
        existing = _generation(fs, directory)
        generation = 0 if existing is None else 1 - existing  # the set the marker does not name
        names = [part_file(rank, generation) for rank in range(len(self.point.parts))]
        writers = [RemotePart(part.refs, part.nodes[0], self.root, self.local, timeout_s=self.timeout_s)
                   for part in self.point.parts]
        calls = [writer.start(directory, file) for writer, file in zip(writers, names)]
        from raysgd.torch.state import checkpoint  # noqa: PLC0415 (torch: see the module docstring)
        from raysgd.torch.state import dcp_blobs  # noqa: PLC0415 (DCP: sharded strategies only, see _dcp_files)

        head = checkpoint.state_from_bytes(self.point.head)
        head["rest"].update(self.point.overlay or {})
        if generation:
            head["metadata"] = dcp_blobs.renamed_files(head["metadata"], {
                restart_point.part_file_name(rank): file for rank, file in enumerate(names)})
        head_file = filesystem.STATE_FILES[generation]
        size, crc32 = filesystem.write_state_file(fs, f"{directory}/{head_file}", checkpoint.state_to_bytes(head))
        deadline = time.monotonic() + self.timeout_s
        written = {file: list(ray.get(call, timeout=max(1.0, deadline - time.monotonic())))
                   for file, call in zip(names, calls)}
        _dcp_files().write_file(fs, f"{directory}/{DCP_METADATA}", head["metadata"])  # every part is written
        return size, crc32, {"parts": written, "file": head_file, "generation": generation}

    def after_marker(self, directory, marker):
        """Delete the files of ``directory`` that a checkpoint's files may have (parts, state files, temporaries of
        ours) and that ``marker`` (just written) does not name: the old set, or a set a killed save left."""
        _delete_unnamed(filesystem.resolve(self.root)[0], directory, marker)


def part_file(rank, generation=0):
    """The DCP file name of saving rank ``rank``'s part in the ``generation`` (0 or 1) set of a checkpoint's files.

    Example:
        >>> part_file(3), part_file(3, 1)
        ('__3_0.distcp', '__3_1.distcp')
    """
    return f"__{rank}_{generation}.distcp"


_OURS = re.compile(r"(__\d+_[01]\.distcp|trainer(\.1)?\.checkpoint)(\.[0-9a-f]{12}\.tmp)?|"
                   r"(\.metadata|checkpoint\.json)\.[0-9a-f]{12}\.tmp")


def _generation(fs, directory):
    """The set of names (0 or 1) the complete checkpoint in ``directory`` uses, or None when there is none."""
    try:
        marker = filesystem.read_marker(fs, directory)
    except filesystem.DamagedCheckpoint:
        return None
    return int(marker.get("generation", 0)) if marker.get("generation", 0) in (0, 1) else 0


def _delete_unnamed(fs, directory, marker):
    named = {marker.get("file", filesystem.STATE_FILE), *(marker.get("parts") or {})}
    try:
        infos = fs.get_file_info(filesystem.pafs.FileSelector(directory, allow_not_found=True))
    except OSError as err:
        logger.warning("Could not list %s to delete the files of the checkpoint it replaced: %s", directory, err)
        return
    for info in infos:
        if info.type == filesystem.pafs.FileType.File and _OURS.fullmatch(info.base_name) \
                and info.base_name not in named:
            try:
                fs.delete_file(info.path)
            except OSError as err:  # left behind: the next save deletes it
                logger.warning("Could not delete %s (of the checkpoint it replaced): %s", info.path, err)


class ShardedFiles:
    """A sharded state's checkpoint as a restart point that the workers load from its files: each rank reads, of the
    parts its new shard overlaps, only the byte ranges it needs (:class:`~raysgd.torch.storage.dcp_files.FileRanges`),
    on its own node; the driver reads only the marker and the head (the small rest, the DCP metadata and the layout).

    Args:
        root: ``storage_path`` (or the folder's path or URI) as :func:`~raysgd.torch.storage.filesystem.resolve`
            takes it on any node; ``directory``: the folder, as that filesystem names it.
        sizes: ``{part file: bytes}`` (the marker's, checked before anything is read); ``head``: the state file's
            bytes.

    Example:
        >>> ShardedFiles("/tmp/run", "/tmp/run/checkpoint_000001", {"__0_0.distcp": 8}, b"").nbytes
        8
    """

    from_files = True  # the run takes a snapshot of the loaded state before it needs one that it can copy or write

    def __init__(self, root, directory, sizes, head):
        self.root, self.directory, self.sizes, self.head = root, directory, dict(sizes), head
        self.overlay = None

    @property
    def nbytes(self):
        return sum(self.sizes.values())

    def source(self, timeout_s=600):
        """The files as a source of byte ranges, read on this node."""
        return _dcp_files().FileRanges(self.root, self.sizes, folder=self.directory)

    def load_args(self, weights_only=False):
        """The arguments of a worker's ``load_restart_point``: ``(self, weights_only, None)``."""
        return self, weights_only, None

    def __repr__(self):
        return f"ShardedFiles({self.directory!r}, {len(self.sizes)} parts, {self.nbytes / 1e6:.1f} MB)"


def sharded_files(root, directory, marker):
    """The :class:`ShardedFiles` of a sharded state's checkpoint ``directory`` (of ``root``'s filesystem) whose
    ``marker`` lists its parts: its head read here (small) and checked against the marker, every part's size checked
    (no part is read here); :class:`~raysgd.torch.storage.filesystem.DamagedCheckpoint` when anything is missing or
    does not match."""
    fs, _ = filesystem.resolve(root)
    head = filesystem.read_state_file(fs, directory, marker)
    listed = marker.get("parts") or {}
    names = sorted(listed, key=_part_rank)
    if names != [part_file(rank, marker.get("generation", 0)) for rank in range(len(names))]:
        raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r}: its parts {names} are not one per rank")
    infos = fs.get_file_info([f"{directory}/{name}" for name in names])
    for name, info in zip(names, infos):
        size = listed[name][0] if isinstance(listed[name], (list, tuple)) and listed[name] else None
        if info.type != filesystem.pafs.FileType.File or info.size != size:
            raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r}: its part {name} is missing or has "
                                               f"{info.size} bytes, the marker says {size}")
    return ShardedFiles(root, directory, {name: listed[name][0] for name in names}, bytes(head))


def find_sharded(path):
    """:func:`sharded_files` of ``path`` (a local folder or a URI) when it is a sharded state's checkpoint directory,
    else None (a file, a whole state's directory): what ``TorchTrainer.load(path)`` loads on the workers."""
    text = expand_path(path)
    if not is_uri(text) and not os.path.isfile(os.path.join(text, filesystem.MARKER_FILE)):
        return None
    fs, directory = filesystem.resolve(text, "checkpoint_path", "TorchTrainer.load")
    marker = filesystem.checked_marker(fs, directory)
    if not marker.get("parts"):
        return None
    return sharded_files(text, directory, marker)


def _read(root, directory, marker, name=None):
    """On a worker's node: ``(info, state bytes)`` of ``directory``'s state file checked against ``marker``;
    ``({"damaged": why}, None)`` when it does not match."""
    fs, _ = filesystem.resolve(root)
    try:
        stream = filesystem.read_state_file(fs, directory, marker, name)
    except filesystem.DamagedCheckpoint as err:
        return {"damaged": str(err)}, None
    return {"bytes": len(stream), "node": restart_point.this_node()}, stream


_read_task = None


def read_part(root, directory, marker, node, local, timeout_s=600):
    """A :class:`~raysgd.torch.restart_points.restart_point.RestartPoint` of a checkpoint's state file, read by a task on
    ``node`` (the driver's for a ``local`` root) into that node's object store, checked against ``marker`` (size,
    CRC-32), never through this process; :class:`~raysgd.torch.storage.filesystem.DamagedCheckpoint` when it does
    not match. The workers then load it safely (``weights_only=True``). A sharded state's checkpoint (its marker
    lists parts): its :class:`ShardedFiles`, which the workers read their ranges of themselves."""
    global _read_task
    if marker.get("parts"):  # a sharded state: the workers read their ranges of the parts themselves
        return sharded_files(root, directory, marker)
    if _read_task is None:
        _read_task = ray.remote(num_cpus=0, max_retries=0, num_returns=2)(_read)
    node = restart_point.this_node() if local else node
    options = {} if node is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}
    info_ref, data_ref = _read_task.options(**options).remote(root, directory, marker)
    info = ray.get(info_ref, timeout=timeout_s)
    if "damaged" in info:
        raise filesystem.DamagedCheckpoint(info["damaged"])
    return restart_point.RestartPoint([data_ref], nbytes=info["bytes"], nodes=[info["node"]])


def _part_rank(name):
    """The saving rank of a part's file name (``__3_0.distcp`` -> 3); -1 for a name of another form."""
    try:
        return int(name.split("_")[2])
    except (IndexError, ValueError):
        return -1
