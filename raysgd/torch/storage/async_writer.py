"""Asynchronous writes on one background thread: one write in flight, the newest one queued, errors surfaced.

Layer 0: standard library only. :class:`AsyncWriter` runs write jobs (callables) one at a time on a
daemon thread, so training continues while a checkpoint uploads:

- **One in flight.** A job runs to its end before the next one starts.
- **The newest wins.** At most one job waits behind the running one; submitting another while one
  waits *replaces* the waiting job (its state is older, so it is dropped, never written). ``submit``
  never blocks.
- **Errors are surfaced.** A failed job is logged at once, and raised (as the ``__cause__`` of a
  :class:`~raysgd.torch.errors.CheckpointError`) by the next ``submit``, ``flush`` or ``close``.
- **Flushed at the end.** ``close()`` (``TorchTrainer.shutdown()``) waits for the running and queued
  jobs; a writer still open when the interpreter exits is flushed by an ``atexit`` hook.
- **Never silent at exit.** When that exit flush finds a failed or unfinished job, it logs an ERROR (also
  on stderr when logging is not configured) and the process exits with status 1, after every other exit
  handler ran (see :func:`_flush_at_exit`).

Example:
    >>> done = []
    >>> writer = AsyncWriter()
    >>> writer.submit(done.append, 1, description="job 1")
    >>> writer.flush(timeout_s=10)
    >>> done
    [1]
    >>> writer.close()
"""
import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, cast

from raysgd.torch.errors import CheckpointError

logger = logging.getLogger(__name__)

_OPEN: "weakref.WeakSet[AsyncWriter]" = weakref.WeakSet()
#: How long the ``atexit`` hook waits for unfinished writes.
EXIT_FLUSH_TIMEOUT_S = 600
#: The exit status of a process whose exit flush found a failed or unfinished write.
EXIT_STATUS_ON_FAILURE = 1
_exit_hook = {"armed": False}


class AsyncWriter:
    """Runs write jobs on one background thread (see the module docstring for the rules)."""

    def __init__(self, name="raysgd-checkpoint-writer"):
        self._name = name
        self._cond = threading.Condition()
        self._queued: tuple[Callable[..., Any], tuple, str] | None = None  # (fn, args, description) waiting to run
        self._running: str | None = None  # description of the job in flight
        self._error = None  # (description, exception) of the first failure not yet raised
        self._closed = False
        self._thread = None
        self.completed = 0  # jobs finished without error
        self.dropped = 0  # queued jobs replaced by a newer one
        _OPEN.add(self)
        _arm_exit_hook()

    @property
    def busy(self):
        """Whether a job runs or waits."""
        with self._cond:
            return self._running is not None or self._queued is not None

    @property
    def failed(self):
        """The description of a failed job whose error was not raised yet, or None."""
        with self._cond:
            return None if self._error is None else self._error[0]

    def submit(self, fn, *args, description="write", raise_error=True):
        """Queue ``fn(*args)``, replacing a job that waits; then raise an earlier job's error, if any (with
        ``raise_error=False`` it stays for the next ``submit``, ``flush`` or ``close`` to raise)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("AsyncWriter.submit: the writer is closed")
            earlier = None
            if raise_error:  # taken before this job is queued: never this job's own error, however fast it fails
                earlier, self._error = self._error, None
            if self._queued is not None:
                logger.debug("%s replaces %s, which had not started", description, self._queued[2])
                self.dropped += 1
            self._queued = (fn, args, description)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        self._raise(earlier)

    def flush(self, timeout_s=None):
        """Wait until no job runs or waits; raise the error of a failed job. ``TimeoutError`` past ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._running is not None or self._queued is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self._name}: {self._running or cast(tuple, self._queued)[2]} still "
                                       f"unfinished after {timeout_s} s")
                self._cond.wait(timeout=left)
        self._raise_error()

    def close(self, timeout_s=None):
        """Flush (see :meth:`flush`), then stop the thread; later submits raise."""
        try:
            self.flush(timeout_s)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            _OPEN.discard(self)

    def _raise_error(self):
        with self._cond:
            failed, self._error = self._error, None
        self._raise(failed)

    @staticmethod
    def _raise(failed):
        if failed is not None:
            description, err = failed
            raise CheckpointError(f"an asynchronous checkpoint write failed ({description}): "
                                  f"{type(err).__name__}: {err}") from err

    def _loop(self):
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._queued is None:
                    return
                (fn, args, description), self._queued = self._queued, None
                self._running = description
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 (kept and raised in the caller's thread)
                logger.error("%s failed: %s: %s", description, type(err).__name__, err, exc_info=err)
                with self._cond:
                    if self._error is None:
                        self._error = (description, err)
            else:
                with self._cond:
                    self.completed += 1
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()


def _arm_exit_hook():
    """Register :func:`_flush_at_exit` (once). Exit handlers run last registered, first run: just before they
    start (in ``threading``'s shutdown step, which precedes them) it is registered again, so that it runs first,
    while Ray, pyarrow's S3 client and logging are still up, and no other handler has run yet."""
    if _exit_hook["armed"]:
        return
    _exit_hook["armed"] = True
    atexit.register(_flush_at_exit)
    register_before_exit = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
    if register_before_exit is not None:
        try:
            register_before_exit(_run_first_at_exit)
        except RuntimeError:  # the interpreter is already shutting down: the plain registration stands
            pass


def _run_first_at_exit():
    atexit.unregister(_flush_at_exit)
    atexit.register(_flush_at_exit)


def _flush_at_exit():
    """A script that ends without ``shutdown()`` still finishes its checkpoint uploads; one that failed (or is
    still unfinished after :data:`EXIT_FLUSH_TIMEOUT_S`) is never silent: an ERROR names it (on stderr too when
    no handler would show it, e.g. a script that configures no logging), the other exit handlers run (Ray's
    shutdown, logging's flush, ...), and the process exits with :data:`EXIT_STATUS_ON_FAILURE`."""
    failures = []
    for writer in list(_OPEN):
        try:
            writer.close(timeout_s=EXIT_FLUSH_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 (reported below: nothing is left to raise to)
            failures.append(err)
    if not failures:
        return
    for failure in failures:
        _log_visibly(f"A checkpoint was not written: the program ended without TorchTrainer.shutdown() while an "
                     f"upload to storage_path had failed or was unfinished ({type(failure).__name__}: {failure}). "
                     f"Exiting with status {EXIT_STATUS_ON_FAILURE}.")
    atexit.unregister(_flush_at_exit)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is not None:
        run_exit_handlers()  # the handlers not yet run (this one ran first), as the interpreter would
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(EXIT_STATUS_ON_FAILURE)  # an exit handler cannot change the exit status otherwise


def _log_visibly(message):
    """Log ``message`` as an ERROR; when no handler of this logger's hierarchy would show it (raysgd's
    ``NullHandler`` only), also through ``logging.lastResort`` (stderr), as an unconfigured logging would."""
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message,
                               None, None)  # type: ignore[arg-type]  # args None: typeshed wants a tuple
    logger.handle(record)
    current: logging.Logger | None
    current, shown = logger, False
    while current is not None and not shown:
        shown = any(not isinstance(h, logging.NullHandler) and record.levelno >= h.level for h in current.handlers)
        current = current.parent if current.propagate else None
    if not shown and logging.lastResort is not None:
        logging.lastResort.handle(record)
