"""A reported checkpoint (a directory on a local disk or a pyarrow.fs URI) and the Result of ``TorchTrainer.fit``.

Part of :mod:`raysgd.train`. :class:`Checkpoint` names a directory; :meth:`Checkpoint.as_directory` gives a local
path to read it (the directory itself when it is local, a temporary download otherwise) and
:meth:`Checkpoint.to_directory` copies it. Remote paths go through :func:`raysgd.torch.storage.filesystem.resolve`
(s3://, gs://, hdfs://, file://).

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> _ = open(os.path.join(folder, "model.pt"), "w").write("weights")
    >>> checkpoint = Checkpoint.from_directory(folder)
    >>> with checkpoint.as_directory() as local:
    ...     sorted(os.listdir(local))
    ['model.pt']
"""
import contextlib
import dataclasses
import os
import shutil
import tempfile

from raysgd.torch.storage import filesystem as _fs


def _local_path(path):
    """The local folder of ``path`` (a plain path or ``file://``), or None for a remote URI."""
    text = os.fspath(path)
    if text.startswith("file://"):
        return text[len("file://"):]
    return None if "://" in text else os.path.abspath(os.path.expanduser(text))


def copy_tree(source, destination):
    """Copy the directory ``source`` to ``destination`` (each a local path or a pyarrow.fs URI)."""
    local_source, local_destination = _local_path(source), _local_path(destination)
    if local_source is not None and local_destination is not None:
        shutil.copytree(local_source, local_destination, dirs_exist_ok=True)
        return
    source_fs, source_path = _fs.resolve(source)
    destination_fs, destination_path = _fs.resolve(destination)
    destination_fs.create_dir(destination_path, recursive=True)
    _fs.pafs.copy_files(source_path, destination_path, source_filesystem=source_fs,
                        destination_filesystem=destination_fs)


class Checkpoint:
    """A directory of checkpoint files, local or at a pyarrow.fs URI (``s3://bucket/run/checkpoint_000002``).

    Example:
        >>> Checkpoint.from_directory("/tmp/ckpt").path
        '/tmp/ckpt'
    """

    def __init__(self, path):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise TypeError(f"Checkpoint(path=...) expects a directory path or URI (str); got "
                            f"{type(path).__name__} {path!r}")
        local = _local_path(path)
        self.path = local if local is not None else os.fspath(path)

    @classmethod
    def from_directory(cls, path):
        """A checkpoint of the directory ``path`` (its files are copied when it is reported)."""
        return cls(path)

    @property
    def is_local(self):
        """True when the checkpoint is a local directory (not a URI such as ``s3://...``)."""
        return "://" not in self.path

    @contextlib.contextmanager
    def as_directory(self):
        """A local directory holding the checkpoint's files: itself when local, else a temporary download."""
        if self.is_local:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="raysgd-checkpoint-") as folder:
            copy_tree(self.path, folder)
            yield folder

    def to_directory(self, path=None):
        """Copy the checkpoint's files to ``path`` (default: a new temporary directory); returns the path."""
        path = path or tempfile.mkdtemp(prefix="raysgd-checkpoint-")
        copy_tree(self.path, path)
        return os.fspath(path)

    def get_metadata(self):
        """Ray Train's checkpoint metadata: always ``{}`` here."""
        return {}

    def __eq__(self, other):
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self):
        return hash(self.path)

    def __repr__(self):
        return f"Checkpoint(path={self.path!r})"


@dataclasses.dataclass
class Result:
    """What ``TorchTrainer.fit()`` returns.

    Attributes:
        metrics: the last metrics rank 0 reported (plus ``"checkpoint_dir_name"`` when it came with a checkpoint).
        checkpoint: the latest reported :class:`Checkpoint` (None if none was reported).
        path: ``storage_path/name``, where the checkpoints are.
        error: the exception that ended the run, or None.
        best_checkpoints: ``[(Checkpoint, metrics)]`` of the checkpoints kept, oldest first.
        num_failures: worker failures recovered from (raysgd's addition).

    Example:
        >>> Result(metrics={"loss": 0.1}, checkpoint=None, path="/tmp/r/exp").metrics["loss"]
        0.1
    """

    metrics: dict
    checkpoint: Checkpoint
    path: str
    error: BaseException = None
    best_checkpoints: list = dataclasses.field(default_factory=list)
    num_failures: int = 0

    @property
    def filesystem(self):
        """The ``pyarrow.fs`` filesystem holding ``path``."""
        return _fs.resolve(self.path)[0]
