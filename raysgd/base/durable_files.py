"""Making a file and a rename durable on a local disk: ``fsync`` of a closed file and of a folder's entries.

Layer -1 (standard library only). The one home of both helpers: the state files (``save()``), a checkpoint's files
and marker in storage, the DCP parts and the CLI's export all write a file, rename it into place and flush both,
and none of them needs torch for it (the tasks that write a checkpoint's files start without torch).

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> path = os.path.join(folder, "f")
    >>> with open(path, "wb") as handle:
    ...     _ = handle.write(b"abc")
    >>> fsync_file(path); fsync_directory(folder)
"""
import os


def fsync_file(path):
    """Flush a closed local file's data to disk (``fsync`` through a fresh descriptor: Linux syncs the file).

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as handle:
        ...     fsync_file(handle.name)
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory):
    """Flush ``directory``'s entries (a rename into it) to disk; a no-op where folders cannot be opened.

    Example:
        >>> import tempfile
        >>> fsync_directory(tempfile.gettempdir())
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # Windows cannot open a folder: its renames are durable without this
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (e.g. certain network mounts) refuse fsync on a folder
        pass
    finally:
        os.close(fd)
