"""Profiler traces of one rank's calls: ``torch.profiler`` around a call, its Chrome trace kept until taken.

Layer 1 (torch only). A worker records a ``train()`` call with :class:`TraceRecorder` when the driver asks for a
trace (``TorchTrainer.profile``); the driver takes each rank's trace afterwards and writes one file per rank.
A trace is the JSON that ``torch.profiler``'s ``export_chrome_trace`` writes: Perfetto (ui.perfetto.dev),
``chrome://tracing`` and TensorBoard's PyTorch profiler plugin open it. CUDA kernels are recorded too when the
rank has a GPU.

Example:
    >>> recorder = TraceRecorder()
    >>> with recorder.record(True):
    ...     _ = torch.ones(4).sum()
    >>> trace = recorder.take()
    >>> b'"traceEvents"' in trace, recorder.take() is None
    (True, True)
"""
import contextlib
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity

from raysgd.base.checks import expect
from raysgd.base.paths import expand_path, is_uri

#: How a trace file of rank ``r`` is named (``*.pt.trace.json``, as ``torch.profiler.tensorboard_trace_handler``
#: names its files, so TensorBoard's profiler plugin finds them).
TRACE_NAME = "rank_{rank}.pt.trace.json"


class TraceRecorder:
    """Records the calls it wraps with ``torch.profiler`` and keeps the latest one's Chrome trace (bytes)."""

    def __init__(self):
        self._trace = None

    @contextlib.contextmanager
    def record(self, enabled):
        """Profile the ``with`` block when ``enabled`` (CPU, and CUDA when available); keep its trace."""
        if not enabled:
            yield
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with torch.profiler.profile(activities=activities) as profiler:
            yield
        handle, path = tempfile.mkstemp(suffix=".pt.trace.json")
        os.close(handle)
        try:
            profiler.export_chrome_trace(path)
            with open(path, "rb") as trace:
                self._trace = trace.read()
        finally:
            os.unlink(path)

    def take(self):
        """The latest trace (bytes), or None; it is handed out once."""
        trace, self._trace = self._trace, None
        return trace


def prepare_logdir(logdir):
    """Create ``logdir`` (a local folder) for the trace files, or raise naming the argument, before any call.

    Example:
        >>> prepare_logdir(42)
        Traceback (most recent call last):
        ...
        TypeError: profile: logdir expects a local folder path (str or os.PathLike); got 42 (int)
    """
    expect(isinstance(logdir, (str, os.PathLike)), "logdir", "a local folder path (str or os.PathLike)", logdir,
           TypeError, caller="profile", got=f"{logdir!r} ({type(logdir).__name__})")
    path = expand_path(logdir)  # ~/traces is the home folder's, not a folder named ~ here
    expect(not is_uri(path), "logdir", "a local folder path (the driver writes the traces)", path, caller="profile")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"profile: logdir {path!r} cannot be created: {err}") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"profile: logdir {path!r} is not writable")
    return path


def write_traces(traces, logdir):
    """Write ``{rank: trace bytes}`` to ``logdir``, one file per rank (:data:`TRACE_NAME`), each replaced whole;
    returns the paths in rank order."""
    paths = []
    for rank in sorted(traces):
        path = os.path.join(logdir, TRACE_NAME.format(rank=rank))
        with open(path + ".tmp", "wb") as handle:
            handle.write(traces[rank])
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths
