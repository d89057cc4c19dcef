"""The thread that runs rank 0's calls when rank 0 lives in the driver (``use_local=True``) beside remote ranks.

Layer 3: standard library only. While rank 0 trains in this thread, the driver's main thread keeps
watching the remote ranks (:mod:`raysgd.torch.execution.worker_group`), so a remote error or death is seen at
once instead of when rank 0's collective times out. All of rank 0's calls run in the same thread,
one at a time, so per-thread state (the current CUDA device) stays put between calls.

A call that must end early (its peers were killed and it is not coming back by itself) gets
:class:`AbandonedCall` raised inside it, which lands the next time the thread runs Python code; a
thread stuck in C code for longer is left behind as a daemon (and logged), and a fresh runner takes
its place.

Example:
    >>> runner = LocalRunner()
    >>> call = runner.submit(lambda: 6 * 7)
    >>> call.wait(5), call.value, call.error
    (True, 42, None)
    >>> runner.stop()
    True
"""
import ctypes
import logging
import queue
import threading

logger = logging.getLogger(__name__)


class AbandonedCall(BaseException):
    """Raised inside rank 0's thread to end a call the driver gave up on (a BaseException, so that
    user code catching ``Exception`` does not swallow it)."""


class LocalCall:
    """One call running in the runner thread: :meth:`done`, :meth:`wait`, then ``value`` or ``error``."""

    def __init__(self, fn):
        self._fn = fn
        self._finished = threading.Event()
        self.value = None
        self.error = None

    def _run(self):
        try:
            self.value = self._fn()
        except BaseException as err:  # noqa: BLE001 (handed to the driver like a remote result)
            self.error = err
        finally:
            self._fn = None
            self._finished.set()

    def done(self):
        return self._finished.is_set()

    def wait(self, timeout_s=None):
        """True once the call finished (waits at most ``timeout_s``)."""
        return self._finished.wait(timeout_s)


#: How long rank 0's call (in this process) gets to end once its peers were killed.
STOP_S = 10.0


class LocalRunner:
    """A daemon thread running submitted calls in order (see the module docstring)."""

    def __init__(self, name="raysgd-rank0"):
        self._name = name
        self._queue: queue.SimpleQueue[LocalCall | None] = queue.SimpleQueue()  # None: the thread ends
        self._thread = None
        self._current = None

    @property
    def ident(self):
        """The thread's id (for its stack), or None before the first call."""
        return self._thread.ident if self._thread is not None else None

    def submit(self, fn):
        """Run ``fn()`` in the runner thread after the calls before it; returns its :class:`LocalCall`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        call = LocalCall(fn)
        self._queue.put(call)
        return call

    def _loop(self):
        while True:
            try:
                call = self._queue.get()
                if call is None:
                    return
                self._current = call
                call._run()
            except AbandonedCall:  # arrived just after the call ended: nothing left to stop
                pass
            finally:
                self._current = None

    def stop(self, timeout_s=10.0):
        """Cancel the queued calls, end the running one and the thread; True when the thread is gone.

        The running call gets ``timeout_s`` to end by itself (its peers were killed, so its
        collective fails), then :class:`AbandonedCall` is raised in it, and it gets ``timeout_s`` more.
        A thread still stuck after that (in C code) is left behind, logged.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call.error = AbandonedCall("cancelled: the worker group was torn down")
                call._finished.set()
        self._queue.put(None)
        thread.join(timeout_s)
        if thread.is_alive() and self._current is not None:
            logger.warning("rank 0's call did not end within %.0f s of its peers' end; interrupting it", timeout_s)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(AbandonedCall))
            thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("rank 0's thread %s is stuck outside Python and is left behind (a daemon thread)",
                           thread.name)
            return False
        return True
