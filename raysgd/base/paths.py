"""How raysgd reads a path a user gives it: a local path's ``~`` is the home folder and a relative path is taken
from the working directory, the same for ``storage_path``, ``save()``, ``load()``, ``raysgd.train``'s run folders and
checkpoints, and the ``raysgd`` command; a URI (``s3://``, ``file://``, ...) is left as it is.

Layer -1 (standard library only), so that every layer reads a path the same way.

Example:
    >>> import os
    >>> expand_path("~/run") == os.path.join(os.path.expanduser("~"), "run"), expand_path("s3://b/~x")
    (True, 's3://b/~x')
    >>> local_path("file:///tmp/runs/exp"), local_path("s3://bucket/runs/exp")
    ('/tmp/runs/exp', None)
"""
import os


def is_uri(text):
    """Whether the path text ``text`` is a URI (``scheme://...``), not a local path.

    Example:
        >>> is_uri("s3://bucket/run"), is_uri("file:///tmp/run"), is_uri("runs/exp")
        (True, True, False)
    """
    return "://" in text


def expand_path(path):
    """``path`` (a str or ``os.PathLike``) as text, a local path's ``~`` expanded (a URI as it is): never a folder
    named ``~`` in the working directory.

    Example:
        >>> expand_path("~/run") == os.path.join(os.path.expanduser("~"), "run"), expand_path("runs/exp")
        (True, 'runs/exp')
    """
    text = os.fspath(path)
    return text if is_uri(text) else os.path.expanduser(text)


def absolute_path(path):
    """``path`` as text: a local path with ``~`` expanded and made absolute, a URI as it is.

    Example:
        >>> absolute_path("runs/exp") == os.path.join(os.getcwd(), "runs", "exp"), absolute_path("s3://b/r")
        (True, 's3://b/r')
    """
    text = expand_path(path)
    return text if is_uri(text) else os.path.abspath(text)


def local_path(path):
    """The local folder or file ``path`` names, absolute (``~`` expanded; a ``file://`` URI's path), or None for a
    remote URI.

    Example:
        >>> local_path("~/runs/exp") == os.path.join(os.path.expanduser("~"), "runs", "exp")
        True
        >>> local_path("file:///tmp/runs/exp"), local_path("s3://bucket/runs/exp")
        ('/tmp/runs/exp', None)
    """
    text = absolute_path(path)
    if text.startswith("file://"):
        return text[len("file://"):]
    return None if is_uri(text) else text
