"""Durable checkpoint storage: atomic checkpoint directories in a local folder, NFS or an object store.

Layer 1 helper: ``pyarrow.fs`` and the standard library, and torch when a state is loaded (imported then:
:func:`_checkpoint`). One code path serves every place ``pyarrow.fs.FileSystem.from_uri`` understands: a local or
NFS folder (a plain path), ``s3://``, ``gs://`` and ``hdfs://`` URIs, with query options such as
``s3://bucket/run?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1`` and credentials
from the usual environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ...).

Layout under the storage path::

    checkpoint_000003/trainer.checkpoint   the trainer state (torch.save bytes, the format of save())
    checkpoint_000003/checkpoint.json      the completion marker, written last

A checkpoint counts only once its marker exists. The marker records the state file's size and
CRC-32, so a truncated or damaged state file is detected, skipped with a warning, and the previous
complete checkpoint is used instead. Loads are safe (``torch.load(..., weights_only=True)``).

Example:
    >>> import tempfile
    >>> from raysgd.torch.state.checkpoint import state_to_bytes
    >>> store = CheckpointStorage(tempfile.mkdtemp(), num_to_keep=2)
    >>> stream = state_to_bytes({"epoch": 1, "models": [], "optimizers": [], "operator": None})
    >>> for epoch in (1, 2, 3):
    ...     _ = store.write(stream, {"epoch": epoch})
    >>> [index for index, _ in store.list()]
    [2, 3]
    >>> store.latest().marker["epoch"]
    3
"""
import io
import json
import logging
import os
import time
import uuid
import zlib

from raysgd import optional
from raysgd.base.checks import argument_error, expect, is_whole
from raysgd.base.durable_files import fsync_directory, fsync_file
from raysgd.base.paths import absolute_path, expand_path, is_uri
from raysgd.torch.errors import CheckpointError

logger = logging.getLogger(__name__)

#: What needs pyarrow here. pyarrow is optional (``pip install "raysgd[storage]"``) and imported on first use,
#: so importing this module (and so ``import raysgd``) never needs it; without it, storage says what to install.
FEATURE = "checkpoint storage (storage_path=..., a checkpoint directory or URI, Tune checkpoints)"
pyarrow = optional.lazy("pyarrow", FEATURE)
pafs = optional.lazy("pyarrow.fs", FEATURE)

STATE_FILE = "trainer.checkpoint"
#: The state file of a sharded state's checkpoint saved over an existing one (``save(path)`` again): its files
#: alternate between two names, so the marker, written last, switches from one complete set to the other.
STATE_FILES = (STATE_FILE, "trainer.1.checkpoint")
MARKER_FILE = "checkpoint.json"
#: The marker of a checkpoint a training function reported (``raysgd.train``): its directory also holds the user's
#: files, so raysgd's own name is a hidden one.
REPORT_MARKER = ".raysgd_report.json"
#: The hidden file of a reported checkpoint's folder keeping the driver's callbacks' state as they were when they
#: heard that report (written by the driver after the checkpoint's marker): a run resuming from the checkpoint hands
#: it back, so a logger goes on from that report (an MLflow run's id and step), not from later reports the resumed
#: function makes again.
CALLBACKS_NOTE = ".raysgd_callbacks.json"
#: raysgd's own files at the top of a reported checkpoint's folder, never part of its content: a folder reported
#: again (a checkpoint the function resumed from) leaves them out, and ``Checkpoint.to_directory()`` copies them not.
REPORT_FILES = (REPORT_MARKER, CALLBACKS_NOTE)
#: The file at the top of a reported checkpoint's folder that holds its metadata (Ray Train's name). Listed in the
#: marker (read back with the rest) but checked for presence only: ``Checkpoint.set_metadata()`` may rewrite it
#: after the checkpoint was reported.
CHECKPOINT_METADATA = ".metadata.json"
PREFIX = "checkpoint_"
FORMAT = 1


class DamagedCheckpoint(CheckpointError):
    """A checkpoint directory that is incomplete or whose state file does not match its marker."""


def resolve(storage_path, argument="storage_path", caller="TorchTrainer"):
    """``(filesystem, path)`` for a folder path or a URI (``s3://``, ``gs://``, ``hdfs://``, ``file://``). A path
    that is neither raises an error naming ``argument`` of ``caller`` (what the user passed it as: ``storage_path``
    of ``TorchTrainer`` by default).

    Example:
        >>> fs, path = resolve("/tmp/run")
        >>> type(fs).__name__, path
        ('LocalFileSystem', '/tmp/run')
        >>> resolve("foo://bucket/ckpt", "checkpoint_path", "TorchTrainer.load")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: TorchTrainer.load: checkpoint_path expects a local folder or a URI that pyarrow.fs understands ...
    """
    expect(isinstance(storage_path, (str, os.PathLike)) and not isinstance(storage_path, bytes), argument,
           "a folder path or a URI such as 's3://bucket/run'", storage_path, TypeError, caller)
    text = os.fspath(storage_path)
    expect(text, argument, "a folder path or a URI", text, caller=caller)
    text = absolute_path(text)
    optional.require("pyarrow.fs", FEATURE)  # a missing pyarrow says what to install, before anything else
    try:
        filesystem, path = pafs.FileSystem.from_uri(text)
    except (pyarrow.ArrowException, ValueError, OSError) as err:
        hint = " (a URI writes a space as %20)" if " " in text else ""
        raise argument_error(argument, "a local folder or a URI that pyarrow.fs understands (s3://, gs://, "
                             "hdfs://, file://)", storage_path, caller=caller,
                             got=f"{storage_path!r}: {err}{hint}") from err
    return filesystem, path.rstrip("/")


def _checkpoint():
    """:mod:`raysgd.torch.state.checkpoint` (torch), imported when first needed: this module imports no torch, so
    the processes of the tasks that write and read a checkpoint's state file (:mod:`~raysgd.torch.storage.parts`)
    start without it."""
    from raysgd.torch.state import checkpoint  # noqa: PLC0415

    return checkpoint


def _join(*parts):
    return "/".join(part.rstrip("/") for part in parts)


def check_state_bytes(stream, name="checkpoint", weights_only=True):
    """Load trainer-state bytes (safely by default); a :class:`CheckpointError` names what is wrong."""
    return _checkpoint().read_state(
        io.BytesIO(stream), name, damaged=DamagedCheckpoint, weights_only=weights_only,
        trust_hint="make the operator's state_dict() return tensors, numbers, strings and containers, start with "
                   "resume=False, or, if you trust the checkpoint, load it with TorchTrainer.load(path, "
                   "weights_only=False)")


def _is_local(filesystem):
    return isinstance(filesystem, pafs.LocalFileSystem)


def write_state_file(filesystem, path, stream):
    """Write ``stream`` (bytes or any buffer) to ``path`` (``fsync``ed on a local disk); returns ``(size, crc32)``.

    Example:
        >>> import os, tempfile
        >>> write_state_file(resolve(tempfile.mkdtemp())[0], os.path.join(tempfile.mkdtemp(), "f"), b"abc")
        (3, 891568578)
    """
    with filesystem.open_output_stream(path) as handle:
        handle.write(stream)
    if _is_local(filesystem):
        fsync_file(path)
    return memoryview(stream).nbytes, zlib.crc32(stream)


def write_checkpoint_dir(filesystem, directory, stream, meta=None):
    """Write ``stream`` and then its marker into ``directory``; returns the marker dict.

    ``stream`` is the state's bytes, or a part written elsewhere: an object whose ``write_to(directory, name)``
    writes the state file there and returns ``(size, crc32)`` (:class:`raysgd.torch.storage.parts.RemotePart`: on
    the node holding the state, never through this process).

    Until the marker is written the directory does not count: a crash mid-write leaves a directory that
    readers skip. On an object store each file is one atomic PUT. On a local disk (or NFS) the state
    file is ``fsync``ed before the marker is written, then the marker, the directory and its parent
    (the new entry), so once this returns a power loss cannot take the checkpoint back, and a marker
    never reaches the disk before the state it describes.
    """
    filesystem.create_dir(directory, recursive=True)
    extra: dict = {}
    if hasattr(stream, "write_to"):  # a part written elsewhere (on the node holding the state)
        size, crc32, *more = stream.write_to(directory, STATE_FILE)
        extra = more[0] if more else {}  # a sharded state's other files: {"parts": {name: [size, crc32]}}
    else:
        size, crc32 = write_state_file(filesystem, _join(directory, STATE_FILE), stream)
    head = extra.get("file", STATE_FILE)  # a sharded state saved over an existing one: the other of STATE_FILES
    files = {head: [size, crc32], **(extra.get("parts") or {})}
    marker = write_marker(filesystem, directory, files, {**(meta or {}), "file": STATE_FILE, **extra, "size": size,
                                                         "crc32": crc32})
    if hasattr(stream, "after_marker"):  # the files the marker no longer names (a checkpoint saved over)
        stream.after_marker(directory, marker)
    return marker


def write_marker(filesystem, directory, files, meta=None, name=MARKER_FILE):
    """Write the completion marker ``name`` of ``directory`` (whose ``files``, ``{relative name: [size, crc32]}``,
    are already written): the format, ``meta`` and the files, so a reader checks each file against it. On a local
    disk the marker, the directory and its parent are ``fsync``ed; a marker that replaces an existing one goes
    through a temporary and one rename (the old marker or the new one, never half of one). Returns the marker dict.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> sorted(write_marker(resolve(folder)[0], folder, {"a.pt": [3, 7]}, {"index": 1}))
        ['files', 'format', 'index', 'time']
    """
    marker = {"format": FORMAT, **(meta or {}), "files": {key: list(value) for key, value in files.items()},
              "time": time.time()}
    path = _join(directory, name)
    local = _is_local(filesystem)
    # a new marker in place (a crash leaves a folder without a complete marker: skipped); elsewhere one PUT (atomic)
    replacing = local and os.path.exists(path)
    target = f"{path}.{uuid.uuid4().hex[:12]}.tmp" if replacing else path
    with filesystem.open_output_stream(target) as handle:
        handle.write(marker_text(marker).encode())
    if local:
        fsync_file(target)
        if replacing:
            os.replace(target, path)
        fsync_directory(directory)
        fsync_directory(os.path.dirname(directory))
    return marker


def marker_text(marker):
    """A marker as the JSON text it is stored as (values JSON cannot hold are stored as their repr)."""
    return json.dumps(marker, sort_keys=True, default=repr)


def read_marker(filesystem, directory, name=MARKER_FILE):
    """The marker ``name`` of ``directory``; :class:`DamagedCheckpoint` when it is missing or unreadable."""
    try:
        with filesystem.open_input_file(_join(directory, name)) as handle:
            marker = json.loads(handle.read().decode())
    except FileNotFoundError as err:
        raise DamagedCheckpoint(f"checkpoint {directory!r} is incomplete (no {name})") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise DamagedCheckpoint(f"checkpoint {directory!r} has a damaged {name}: {err}") from err
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise DamagedCheckpoint(f"checkpoint {directory!r}: {name} is not a format-{FORMAT} marker")
    return marker


def read_path(path, weights_only=True):
    """What ``TorchTrainer.load(path)`` loads: the state in a file :func:`raysgd.torch.state.checkpoint.save_state` wrote
    (a dict), or the bytes of a checkpoint directory (``storage_path``'s ``checkpoint_000007/``, a Tune
    checkpoint, or such a directory's URI), checked against its marker.

    Example:
        >>> read_path("/tmp")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        raysgd.torch.errors.CheckpointError: checkpoint path '/tmp' is a directory without checkpoint.json ...
    """
    text = expand_path(path)
    if is_uri(text) or os.path.isfile(os.path.join(text, MARKER_FILE)):
        filesystem, directory = resolve(text, "checkpoint_path", "TorchTrainer.load")
        return read_checkpoint_dir(filesystem, directory, weights_only=weights_only)[0]
    if os.path.isdir(text):
        if os.path.isfile(os.path.join(text, STATE_FILE)):  # a directory holding a file save() wrote
            return _checkpoint().load_state(os.path.join(text, STATE_FILE), weights_only=weights_only)
        raise CheckpointError(f"checkpoint path {text!r} is a directory without {MARKER_FILE} or {STATE_FILE}: "
                              f"pass the file save() wrote, or a checkpoint directory of storage_path or Tune")
    return _checkpoint().load_state(text, weights_only=weights_only)


def read_checkpoint_dir(filesystem, directory, weights_only=True):
    """``(stream, marker)`` of a complete checkpoint directory, checked against its marker and loaded (safely by
    default). The marker may name only the state file (``"file"``: one of :data:`STATE_FILES`, or no ``file``):
    any other name is a damaged checkpoint, never a path to follow."""
    marker = checked_marker(filesystem, directory)
    stream = read_state_file(filesystem, directory, marker)
    check_state_bytes(stream, name=f"checkpoint {directory!r}", weights_only=weights_only)
    return stream, marker


def checked_marker(filesystem, directory):
    """The marker of ``directory``, checked to name the state file (any other name is a damaged checkpoint, never a
    path to follow); :class:`DamagedCheckpoint` otherwise."""
    marker = read_marker(filesystem, directory)
    if marker.get("file", STATE_FILE) not in STATE_FILES:
        raise DamagedCheckpoint(f"checkpoint {directory!r} is damaged: its {MARKER_FILE} names the state file "
                                f"{marker.get('file')!r}; expected one of {', '.join(map(repr, STATE_FILES))}")
    return marker


def state_file_of(marker):
    """The name of the state file a checkpoint's ``marker`` names: ``trainer.checkpoint``, or the other of
    :data:`STATE_FILES` for a sharded state saved over an existing one (see :func:`checked_marker`).

    Example:
        >>> state_file_of({"file": "trainer.1.checkpoint"}), state_file_of({})
        ('trainer.1.checkpoint', 'trainer.checkpoint')
    """
    return marker.get("file", STATE_FILE)


def read_state_file(filesystem, directory, marker, name=None):
    """The state file the marker names (or, with ``name``, a sharded state's part that ``marker["parts"]`` lists)
    of ``directory``, checked against the marker's size and CRC-32 (not loaded); :class:`DamagedCheckpoint` when it
    is missing or does not match."""
    if name is None or name == state_file_of(marker):
        name = state_file_of(marker)
        size, crc32 = marker.get("size"), marker.get("crc32")
    else:
        listed = (marker.get("parts") or {}).get(name)
        if not isinstance(listed, (list, tuple)) or len(listed) != 2:
            raise DamagedCheckpoint(f"checkpoint {directory!r}: its {MARKER_FILE} lists no part {name!r}")
        size, crc32 = listed
    try:
        # a random-access file reads in one request; an unbuffered input stream is 20x slower on S3
        with filesystem.open_input_file(_join(directory, name)) as handle:
            stream = handle.read()
    except FileNotFoundError as err:
        raise DamagedCheckpoint(f"checkpoint {directory!r} lost its file {name}") from err
    if len(stream) != size or zlib.crc32(stream) != crc32:
        raise DamagedCheckpoint(f"checkpoint {directory!r} is damaged: its file {name} has {len(stream)} bytes "
                                f"(CRC-32 {zlib.crc32(stream)}), the marker says {size} (CRC-32 {crc32})")
    return stream


class Restored:
    """A checkpoint read back: ``stream`` (state bytes), ``marker`` (dict), ``path`` (its directory)."""

    def __init__(self, stream, marker, path):
        self.stream, self.marker, self.path = stream, marker, path

    def __repr__(self):
        return f"Restored({self.path!r}, epoch={self.marker.get('epoch')})"


def child_uri(storage_path, name):
    """``storage_path/name`` for a folder path or a URI, a URI's query options kept at its end.

    Example:
        >>> child_uri("s3://bucket/runs?endpoint_override=127.0.0.1:9000", "exp")
        's3://bucket/runs/exp?endpoint_override=127.0.0.1:9000'
        >>> child_uri("/tmp/runs/", "exp")
        '/tmp/runs/exp'
    """
    text = os.fspath(storage_path)
    if is_uri(text) and "?" in text:
        base, query = text.split("?", 1)
        return f"{_join(base, name)}?{query}"
    return _join(text, name)


def numbered(index):
    """The directory name of checkpoint ``index`` (``checkpoint_000007``)."""
    return f"{PREFIX}{index:06d}"


def keep_newest(num_to_keep):
    """The default retention: ``keep(complete)`` -> the indices of the newest ``num_to_keep`` of ``complete`` (``[(index,
    marker)]``, oldest first); all of them when ``num_to_keep`` is None.

    Example:
        >>> sorted(keep_newest(2)([(1, {}), (2, {}), (5, {})]))
        [2, 5]
    """
    def keep(complete):
        chosen = complete if num_to_keep is None else complete[-num_to_keep:]
        return {index for index, _ in chosen}

    return keep


class CheckpointStorage:
    """Checkpoint directories under ``storage_path``, each complete once its marker is written, keeping the newest
    ``num_to_keep`` complete ones (None: all) or those a ``keep`` policy picks.

    The trainer's own checkpoints (the operator API's durable runs) are numbered ``checkpoint_NNNNNN`` and hold the
    state file; a training function's reported checkpoints (``raysgd.train``) hold the files every rank reported,
    their marker named ``marker`` (:data:`REPORT_MARKER`), and may carry a name of the user's choosing (the marker's
    ``index`` then orders them). One marker format (:func:`write_marker`: the files with their sizes and CRC-32),
    one listing, one pruning and one writable check serve both.

    Not safe for two runs writing to the same ``storage_path`` at once. See the module docstring for the
    layout and an example.
    """

    def __init__(self, storage_path, num_to_keep=2, marker=MARKER_FILE, keep=None):
        expect(num_to_keep is None or is_whole(num_to_keep, 1), "num_to_keep",
               "an int >= 1 (checkpoints kept in storage_path)", num_to_keep, caller="TorchTrainer")
        num_to_keep = None if num_to_keep is None else int(num_to_keep)  # numpy's, or 2.0, too: kept as an int
        self.filesystem, self.path = resolve(storage_path)
        self.storage_path = os.fspath(storage_path)
        text = self.storage_path  # what resolve() gives the same filesystem from, on any node
        self.root = absolute_path(text)
        self.local = _is_local(self.filesystem)
        self.num_to_keep = num_to_keep
        self.marker = marker
        self._keep = keep or keep_newest(num_to_keep)

    def __repr__(self):
        return f"CheckpointStorage({self.storage_path!r}, num_to_keep={self.num_to_keep})"

    def uri(self, directory):
        """The path or URI of ``directory`` (a path inside the filesystem, as :meth:`list` gives) as a user names it:
        a URI keeps its scheme and query options."""
        if not is_uri(self.storage_path):
            return directory
        relative = directory[len(self.path):].lstrip("/")
        return child_uri(self.storage_path, relative)

    def check_writable(self):
        """Create the folder, write a small file into it and delete it: a ``storage_path`` this process cannot
        write (under a regular file, read-only, a missing bucket, no credentials) fails here, naming it,
        instead of at the first checkpoint upload."""
        probe = _join(self.path, f".raysgd-write-check-{uuid.uuid4().hex[:12]}")
        try:
            self.filesystem.create_dir(self.path, recursive=True)
            with self.filesystem.open_output_stream(probe) as handle:
                handle.write(b"raysgd")
            self.filesystem.delete_file(probe)
        except (OSError, pyarrow.ArrowException) as err:
            raise argument_error("storage_path", "a folder or URI this process can write (a test file is written "
                                 "and deleted there)", self.storage_path, caller="TorchTrainer",
                                 got=f"{self.storage_path!r}: writing {probe!r} failed: {type(err).__name__}: "
                                     f"{err}") from err

    def list(self):
        """``[(index, directory)]`` of every checkpoint directory, complete or not, oldest first: the numbered ones
        by their name, one of another name by its marker's ``index`` (without a readable marker it is left out)."""
        return self._scan()[0]

    def _scan(self):
        """``(list(), highest index)``: the highest index is also that of any other entry of a checkpoint's name (a
        file ``checkpoint_000007`` is no checkpoint, but a new one must not take its name); 0 when there is none."""
        try:
            infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except OSError as err:
            raise CheckpointError(f"cannot list storage_path {self.storage_path!r}: {err}") from err
        found, highest = [], 0
        for info in infos:
            name = info.base_name
            numbered_name = name.startswith(PREFIX) and name[len(PREFIX):].isdigit()
            if numbered_name:
                highest = max(highest, int(name[len(PREFIX):]))
            if info.type != pafs.FileType.Directory or name.startswith("."):
                continue
            if numbered_name:
                found.append((int(name[len(PREFIX):]), _join(self.path, name)))
            elif self.marker != MARKER_FILE:  # a reported checkpoint's own name: its marker numbers it
                try:
                    index = read_marker(self.filesystem, _join(self.path, name), self.marker).get("index")
                except DamagedCheckpoint:
                    continue
                if isinstance(index, int):
                    found.append((index, _join(self.path, name)))
                    highest = max(highest, index)
        return sorted(found), highest

    def write_note(self, name, note):
        """Keep the small JSON-able ``note`` as the hidden file ``name`` of the folder (a driver's state beside the
        checkpoints, such as its callbacks'): replaced atomically (a rename on a local disk, one PUT elsewhere)."""
        path = _join(self.path, name)
        text = marker_text(note).encode()
        if self.local:
            temporary = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(temporary, "wb") as handle:
                handle.write(text)
            os.replace(temporary, path)
        else:
            with self.filesystem.open_output_stream(path) as handle:
                handle.write(text)

    def read_note(self, name):
        """The note :meth:`write_note` kept as ``name``, or None (none, or unreadable: logged)."""
        try:
            with self.filesystem.open_input_file(_join(self.path, name)) as handle:
                return json.loads(handle.read().decode())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            logger.warning("Could not read %s of %s: %s", name, self.storage_path, err)
            return None

    def next_index(self):
        """The index a new checkpoint takes: one past every directory's (complete or not), and past any other entry
        of a checkpoint's name (a file there is never overwritten, nor a checkpoint's place)."""
        return self._scan()[1] + 1

    def write(self, stream, meta=None):
        """Write a new checkpoint (numbered after every existing one), then prune; returns its directory.

        Older checkpoints are pruned only after the new one is durable (see :func:`write_checkpoint_dir`)."""
        existing, highest = self._scan()
        index = highest + 1
        directory = _join(self.path, numbered(index))
        started = time.monotonic()
        marker = write_checkpoint_dir(self.filesystem, directory, stream, {**(meta or {}), "index": index})
        logger.debug("Checkpoint %s written (%.1f MB in %.2f s)", directory, marker["size"] / 1e6,
                    time.monotonic() - started)
        self.prune(existing + [(index, directory)])
        return directory

    def _marker_of(self, directory):
        try:
            return read_marker(self.filesystem, directory, self.marker)
        except DamagedCheckpoint:
            return None

    def prune(self, entries=None, protect=()):
        """Delete the complete checkpoints the retention policy does not keep (never the newest, nor the directories
        in ``protect``: one a run is resuming from), and incomplete ones older than the newest complete one."""
        entries = self.list() if entries is None else entries
        protect = set(protect)
        markers = {index: self._marker_of(directory) for index, directory in entries}
        complete = [(index, markers[index]) for index, _ in entries if markers[index] is not None]
        if not complete:
            return
        keep = set(self._keep(complete)) | {complete[-1][0]}  # the newest is what a restart resumes from
        for index, directory in entries:
            if index in keep or index > complete[-1][0] or directory in protect:
                continue
            try:  # the marker first: a directory half deleted must never look complete
                self.filesystem.delete_file(_join(directory, self.marker))
            except FileNotFoundError:
                pass
            try:
                self.filesystem.delete_dir(directory)
            except (FileNotFoundError, OSError) as err:
                logger.warning("Could not delete old checkpoint %s: %s", directory, err)

    def candidates(self, check=None):
        """``[(directory, marker)]`` of the complete checkpoints, newest first, reading only their markers (a missing
        or unreadable marker, or one ``check(filesystem, directory, marker)`` refuses with
        :class:`DamagedCheckpoint`, is skipped with a warning): what a resume tries in turn, reading each state file
        where it is loaded (see :func:`read_state_file`). The default check: the marker names the state file."""
        found = []
        for _, directory in reversed(self.list()):
            try:
                marker = read_marker(self.filesystem, directory, self.marker)
                if check is not None:
                    check(self.filesystem, directory, marker)
                elif marker.get("file", STATE_FILE) != STATE_FILE:
                    checked_marker(self.filesystem, directory)  # raises, naming the file
                found.append((directory, marker))
            except DamagedCheckpoint as err:  # newer than any complete one: the one a resume would have used
                (logger.debug if found else logger.warning)(
                    "Skipping checkpoint %s (%s); falling back to the previous one", directory, err)
        return found

    def latest(self):
        """The newest complete, undamaged checkpoint as :class:`Restored`, or None when there is none.

        A damaged or incomplete newer one is skipped with a warning. A checkpoint that a safe load refuses
        raises :class:`~raysgd.torch.errors.CheckpointError` (older ones would not be what you trained).
        """
        for _, directory in reversed(self.list()):
            try:
                stream, marker = read_checkpoint_dir(self.filesystem, directory)
            except DamagedCheckpoint as err:
                logger.warning("Skipping checkpoint %s (%s); falling back to the previous one", directory, err)
                continue
            return Restored(stream, marker, directory)
        return None
