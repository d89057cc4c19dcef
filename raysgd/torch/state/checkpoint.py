"""The state's bytes and checkpoint files: serialised once (:func:`serialise`), written atomically (temporary file and
rename), loaded safely with clear errors.

Layer 2 (torch, numpy and the standard library). A checkpoint is the trainer state dict
``{epoch, global_step, operator, models, optimizers[, schedulers][, amp_*]}``. A file gets the
permissions the umask allows (``0666 & ~umask``, like ``open(path, "wb")``), and the folder is
fsynced after the rename, so the new name survives a power loss.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_state({"epoch": 1, "models": [], "optimizers": [], "operator": None}, path) == path
    True
    >>> load_state(path)["epoch"]
    1
"""
import io
import os
import pickle
import uuid
import zipfile
from typing import IO, cast

import numpy
import torch

from raysgd.base.checks import argument_error
from raysgd.base.durable_files import fsync_directory
from raysgd.base.paths import expand_path, is_uri
from raysgd.torch.errors import CheckpointError

_REQUIRED = ("epoch", "models", "optimizers")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6 is a zip archive
_TORCH_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickled object of torch.save's legacy format (RaySGD 1.x on old torch)


def state_to_bytes(state):
    """``torch.save`` bytes of ``state``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def serialise(record):
    """``record`` serialised once with ``torch.save``, as a read-only ``memoryview`` of the buffer it was written to
    (no ``getvalue()`` copy); ``torch.load(io.BytesIO(view))`` reads it back. The buffer is sized for the record's
    tensors up front and large writes are copied by numpy, which lets go of the interpreter lock meanwhile: a thread
    serialising a large state (the call-start snapshot) leaves the training thread running (an ``io.BytesIO`` held
    the lock for each tensor's whole copy: a 256 MB state stalled the other thread for ~200 ms at a time, ~40 ms
    with this buffer).

    Example:
        >>> import io
        >>> view = serialise({"x": torch.arange(3)})
        >>> torch.load(io.BytesIO(view))["x"].tolist(), view.readonly
        ([0, 1, 2], True)
    """
    buffer = _GrowingBuffer(_tensor_bytes(record) + (1 << 16))
    torch.save(record, cast(IO[bytes], buffer))  # torch's stub asks for IO[bytes]; a file with write() will do
    return buffer.view()


def _tensor_bytes(value, seen=None):
    """The bytes of the distinct tensor storages in ``value`` (nested dicts, lists and tuples)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return 0
    return sum(_tensor_bytes(item, seen) for item in value)


class _GrowingBuffer:
    """A writable file for ``torch.save``: one byte array, grown (doubled) when a write does not fit."""

    def __init__(self, capacity):
        self._array, self._size = numpy.empty(capacity, dtype=numpy.uint8), 0

    def write(self, data):
        source = numpy.frombuffer(memoryview(data).cast("B"), dtype=numpy.uint8)
        end = self._size + source.size
        if end > self._array.size:
            grown = numpy.empty(max(end, 2 * self._array.size), dtype=numpy.uint8)
            numpy.copyto(grown[:self._size], self._array[:self._size])
            self._array = grown
        numpy.copyto(self._array[self._size:end], source)
        self._size = end
        return source.size

    def flush(self):
        """Nothing to flush (``torch.save`` may ask)."""

    def view(self):
        """What was written, read-only."""
        view = memoryview(self._array)  # type: ignore[arg-type]  # numpy: a Buffer on 3.12+ only
        return view[:self._size].toreadonly()


def state_from_bytes(stream, map_location="cpu", weights_only=False):
    """The state dict in :func:`state_to_bytes` bytes. The default trusts them (they come from this job's own
    workers); ``weights_only=True`` loads bytes of unknown origin safely (see :func:`read_state`)."""
    if weights_only:
        return read_state(io.BytesIO(stream), "the state bytes", weights_only=True, map_location=map_location,
                          trust_hint="if you trust them, pass weights_only=False")
    return torch.load(io.BytesIO(stream), map_location=map_location, weights_only=False)


def checked_stream(state, weights_only=True):
    """``(stream, weights_only)`` for ``TorchTrainer.load_state_dict(state)``: ``state`` (a trainer state dict or its
    bytes) checked, as state bytes, and whether the workers must load them safely. Bytes are loaded here with
    ``weights_only`` to check them; a dict is checked for the state's keys and serialised here (so the workers
    may trust those bytes). Anything else raises :class:`CheckpointError` saying it is not a raysgd checkpoint.

    Example:
        >>> checked_stream({"epoch": 1})
        Traceback (most recent call last):
        ...
        raysgd.torch.errors.CheckpointError: load_state_dict expects the trainer state that state_dict() returns; got something that is not a raysgd checkpoint: a dict without the keys 'models', 'optimizers' of the trainer state
    """
    if isinstance(state, (bytes, bytearray, memoryview)):
        stream = bytes(state)
        read_state(io.BytesIO(stream), "load_state_dict's bytes", weights_only=weights_only,
                   trust_hint="if you trust them, pass load_state_dict(..., weights_only=False)")
        return stream, weights_only
    problem = state_problem(state)
    if problem is not None:
        raise argument_error("load_state_dict", "the trainer state that state_dict() returns", state, CheckpointError,
                             got=f"something that is not a raysgd checkpoint: {problem}")
    return state_to_bytes(state), False


def save_state(state, path):
    """Write ``state`` to ``path`` (``~`` expanded) atomically: a crash mid-write leaves any older file at ``path``
    intact. Returns the path written."""
    path = expand_path(path)
    expected = ("the path of a file to write (a sharded state, strategy='fsdp', is saved as a folder unless "
                "consolidated)")
    if not path:
        raise argument_error("checkpoint_path", expected, path, caller="TorchTrainer.save")
    if is_uri(path):  # os.makedirs would make a local folder named after the scheme ('s3:')
        raise argument_error("checkpoint_path", "a local file path: a whole state's file is written here (a URI takes "
                             "a sharded state's folder, strategy='fsdp'; storage_path='s3://...' keeps whole states in "
                             "an object store)", path, caller="TorchTrainer.save")
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise argument_error("checkpoint_path", expected, path, IsADirectoryError, caller="TorchTrainer.save",
                             got=f"{path!r}, a folder")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    # os.open with 0o666 lets the umask decide (tempfile.mkstemp would force 0600, unreadable to the group).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)
    return path


def load_state(path, weights_only=True):
    """Read a checkpoint written by :func:`save_state`.

    With ``weights_only=True`` (the default) the file can hold only tensors, numbers, strings and
    containers, so loading it cannot run code. Pass ``weights_only=False`` only for files you trust
    whose operator state needs arbitrary pickled objects. A path's ``~`` is expanded, as ``save_state`` does.
    """
    path = expand_path(path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint file {path!r} is a directory: pass the file save() wrote (a checkpoint "
                              f"directory of storage_path or Tune loads with TorchTrainer.load)")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path!r} does not exist")
    return read_state(path, f"checkpoint {path!r}", weights_only=weights_only,
                      trust_hint="if you trust the file, load it with weights_only=False")


def read_state(source, name, *, weights_only=True, trust_hint, damaged=CheckpointError, map_location="cpu"):
    """``torch.load`` of a trainer state (a path or a seekable binary file object) onto the CPU, with clear errors.

    Anything that is not a file ``torch.save`` wrote holding a trainer state (a text file, a plain pickle,
    another zip archive, an empty file, a tensor, a dict without the state's keys) raises ``damaged`` (a
    :class:`CheckpointError` class) naming ``name`` and saying it is not a raysgd checkpoint; so does a
    damaged torch file. A safe load (``weights_only=True``) of a torch file holding other objects raises
    :class:`CheckpointError` ending with ``trust_hint``.

    Example:
        >>> import io
        >>> buffer = io.BytesIO(state_to_bytes({"epoch": 1, "models": [], "optimizers": []}))
        >>> read_state(buffer, "my state", trust_hint="")["epoch"]
        1
        >>> read_state(io.BytesIO(b"epoch 1 went well"), "notes.txt", trust_hint="")
        Traceback (most recent call last):
        ...
        raysgd.torch.errors.CheckpointError: notes.txt is not a raysgd checkpoint: not a file torch.save wrote (a text file, ...
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            return read_state(handle, name, weights_only=weights_only, trust_hint=trust_hint, damaged=damaged,
                              map_location=map_location)
    foreign = _foreign_format(source)
    if foreign is not None:
        raise damaged(f"{name} is not a raysgd checkpoint: {foreign}; pass a file TorchTrainer.save() wrote "
                      f"(or a checkpoint directory of storage_path or Tune)")
    try:
        state = torch.load(source, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if weights_only and "weights_only" in str(err):
            raise CheckpointError(f"{name} holds objects that a safe load (weights_only=True) refuses; {trust_hint}. "
                                  f"Detail: {str(err).splitlines()[0]}") from err
        raise damaged(f"{name} is corrupted or truncated: {err}") from err
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 (a damaged torch file fails in many ways: EOFError, IndexError, ...)
        raise damaged(f"{name} is corrupted or truncated: {type(err).__name__}: {err}") from err
    problem = state_problem(state)
    if problem is not None:
        raise damaged(f"{name} is not a raysgd checkpoint: {problem}")
    return state


def state_problem(state):
    """Why ``state`` is not a trainer state (a short phrase), or None when it is one.

    Example:
        >>> state_problem({"epoch": 1, "models": [], "optimizers": []}) is None
        True
        >>> state_problem({"weight": 1})
        "a dict without the keys 'epoch', 'models', 'optimizers' of the trainer state"
    """
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not the trainer state (a dict with keys {', '.join(_REQUIRED)})"
    if is_sharded_head(state):  # a sharded state's head: its models and optimizers are in the parts
        epoch = state["rest"].get("epoch")
        return None if isinstance(epoch, int) and not isinstance(epoch, bool) else \
            f"a sharded state's head whose 'epoch' is a {type(epoch).__name__}, not an int"
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        return f"a dict without the keys {', '.join(map(repr, missing))} of the trainer state"
    if not isinstance(state["epoch"], int) or isinstance(state["epoch"], bool):
        return f"its 'epoch' is a {type(state['epoch']).__name__}, not an int"
    for key in ("models", "optimizers"):
        if not isinstance(state[key], (list, tuple)):
            return f"its {key!r} is a {type(state[key]).__name__}, not a list of state dicts"
    return None


def is_sharded_head(state):
    """Whether ``state`` is the head of a sharded state (``{"rest": {..., "sharded": True}, "metadata": bytes[,
    "layout": {...}]}``: the rest of the state, the DCP metadata of its parts, one per rank, and where their tensor
    items' raw bytes start).

    Example:
        >>> is_sharded_head({"rest": {"epoch": 1, "sharded": True}, "metadata": b""}), is_sharded_head({"epoch": 1})
        (True, False)
    """
    return isinstance(state, dict) and {"rest", "metadata"} <= set(state) <= {"rest", "metadata", "layout"} \
        and isinstance(state["rest"], dict) and state["rest"].get("sharded") is True


def _foreign_format(handle):
    """What ``handle`` holds when it cannot be a file ``torch.save`` wrote (a phrase), else None; the position
    is left where it was. Only the header is read; a legacy torch header is unpickled with no globals allowed."""
    start = handle.tell()
    try:
        head = handle.read(len(_ZIP_MAGIC))
        handle.seek(start)
        if not head:
            return "the file is empty"
        if head == _ZIP_MAGIC:
            try:
                names = zipfile.ZipFile(handle).namelist()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError):
                return None  # a truncated torch.save archive: torch.load says it is damaged
            if any(n.endswith("/constants.pkl") for n in names):
                return "a TorchScript archive (torch.jit.save), not a file torch.save wrote"
            if not any(n.endswith("/data.pkl") for n in names):
                return "a zip archive that is not a file torch.save wrote"
            return None
        try:
            first = _NoGlobals(handle).load()
        except Exception:  # noqa: BLE001 (text, random bytes, a pickle needing classes: not torch's header)
            first = None
        if first != _TORCH_MAGIC:
            return "not a file torch.save wrote (a text file, a plain pickle or other data)"
        return None
    finally:
        handle.seek(start)


class _NoGlobals(pickle.Unpickler):
    """Unpickles plain values only: any class or function reference is refused (nothing can run)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused")
