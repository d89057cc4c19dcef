"""The driver's progress bar (``use_tqdm=True``): rank 0 reports, rate-limited, and one tqdm bar on stderr shows it.

Helper of layer 7 (:mod:`raysgd.torch.torch_trainer`): imports ray, and tqdm once a bar is shown.
The worker never imports this module. Rank 0 alone receives a :class:`ProgressReporter` as an
argument of ``train_epoch``; the operator's per-batch hook calls it (``operator.progress_reporter``). The
reporter keeps the epoch's running losses and forwards a small state dict at most every
``SGD_PROGRESS_INTERVAL_S`` seconds (default 0.5), plus a last one when the epoch ends: to a
:class:`~raysgd.torch.integrations.mailbox.Mailbox` (a 0-CPU actor next to the driver) when rank 0 is a Ray
actor, or straight to the bar when rank 0 lives in the driver (``use_local=True``). While it waits
for the workers, the driver reads the mailbox without blocking (the worker group's ``on_tick``).
With ``use_tqdm=False`` none of this exists.

Example:
    >>> shown = []
    >>> reporter = ProgressReporter(lambda state, final: shown.append(state), call_id=1, interval_s=60)
    >>> reporter.begin(total=3)
    >>> for i in range(3):
    ...     reporter(i, {"train_loss": float(i)}, {"epoch_idx": 2, "num_epochs": 10})
    >>> reporter.end()
    >>> [(s["n"], s["total"], s["desc"], s["losses"]) for s in shown]
    [(1, 3, '3/10e', {'loss': 0.0}), (3, 3, '3/10e', {'loss': 1.0})]
"""
import contextlib
import logging
import sys
import time

import ray
import torch

from raysgd import optional
from raysgd.base import environment
from raysgd.base.checks import is_number
from raysgd.meters import AverageMeterCollection
from ray.exceptions import GetTimeoutError, RayError

from raysgd.torch.integrations.mailbox import Mailbox
from raysgd.torch.sharding.epoch_order import stream_length

logger = logging.getLogger(__name__)



def require_tqdm():
    """Raise ``ValueError`` (as RaySGD 1.12 did) when tqdm is not installed.

    Example:
        >>> require_tqdm()  # tqdm is installed here
    """
    try:
        optional.require("tqdm", "TorchTrainer(use_tqdm=True)")
    except optional.MissingExtra as err:
        raise ValueError(str(err)) from err


def describe(info):
    """The bar's description: ``"3/10e"`` with ``info["num_epochs"]``, else ``"3e"`` (epoch_idx is 0-based).

    Example:
        >>> describe({"epoch_idx": 2, "num_epochs": 10}), describe({"epoch_idx": 0})
        ('3/10e', '1e')
    """
    epoch = int(info.get("epoch_idx", 0)) + 1
    num_epochs = info.get("num_epochs")
    return f"{epoch}/{num_epochs}e" if num_epochs else f"{epoch}e"


def _is_loss(value):
    """A real number or a one-element real tensor (read later, at most once per update sent)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype is not torch.bool and not value.is_complex()
    return is_number(value)


class ProgressReporter:
    """Rank 0's side: running losses of the epoch, forwarded to ``sink(state, final)`` at a limited rate.

    ``state`` is ``{"call", "n", "total", "desc", "losses", "elapsed"}``: the batches done, the
    expected total (``num_steps``, else the loader's length, else None), the description, the
    running mean of every numeric metric whose name contains ``loss`` (``train_loss`` is shown as
    ``loss``; a tensor is summed on its device and read only when a state is sent), and the seconds
    since the epoch began on rank 0 (so the bar's rate is rank 0's).

    Example:
        >>> sent = []
        >>> reporter = ProgressReporter(lambda state, final: sent.append(final), call_id=7, interval_s=60)
        >>> reporter.begin(total=None)
        >>> for i in range(100):
        ...     reporter(i, {"train_loss": 1.0}, {})
        >>> reporter.end()
        >>> sent  # the first batch, then only the epoch's end: not one update per batch
        [False, True]
    """

    def __init__(self, sink, call_id, interval_s=None):
        self._sink = sink
        self.call_id = call_id
        self.interval_s = environment.get("SGD_PROGRESS_INTERVAL_S") if interval_s is None else float(interval_s)
        self.begin()

    def begin(self, total=None):
        """Start an epoch of ``total`` batches (None when unknown)."""
        self._total = total
        self._n = 0
        self._desc = ""
        self._losses = AverageMeterCollection()  # tensors stay on the device until state() reads them
        self._last_sent = float("-inf")
        self._began = time.monotonic()

    @contextlib.contextmanager
    def attach(self, operator, num_steps=None, source=None):
        """Feed this reporter from ``operator``'s per-batch hook during the block (the worker's epoch).

        The total is ``num_steps`` when given, else ``len(source)`` when it has a length.
        """
        self.begin(num_steps if num_steps is not None else stream_length(source))
        operator.progress_reporter = self
        try:
            yield self
        finally:
            operator.progress_reporter = None
            self.end()

    def __call__(self, batch_idx, metrics, info):
        """Record one finished batch; forward the state if ``interval_s`` passed since the last one."""
        self._n = batch_idx + 1
        self._desc = describe(info or {})
        losses = {key: value for key, value in metrics.items() if "loss" in str(key) and _is_loss(value)}
        if losses:
            self._losses.update(losses)
        now = time.monotonic()
        if now - self._last_sent >= self.interval_s:
            self._last_sent = now
            self._sink(self.state(), False)

    def end(self):
        """Forward the epoch's final state (always, whatever the rate limit)."""
        self._sink(self.state(), True)

    def state(self):
        """The current state dict (see the class docstring); reads the device once per device."""
        meters = self._losses.state()["meters"]
        losses = {("loss" if key == "train_loss" else str(key)): meter["sum"] / meter["count"]
                  for key, meter in meters.items()}
        return {"call": self.call_id, "n": self._n, "total": self._total, "desc": self._desc, "losses": losses,
                "elapsed": time.monotonic() - self._began}


class _MailboxSink:
    """How a remote rank 0 sends states: fire-and-forget, the epoch's last one awaited under a deadline.

    Progress is never worth failing the training for: a lost update is logged at debug level.
    """

    def __init__(self, mailbox):
        self._mailbox = mailbox

    def __call__(self, state, final):
        try:
            ref = self._mailbox.post(state, state["call"])
            if final:
                ray.get(ref, timeout=environment.get("SGD_PROGRESS_FINAL_TIMEOUT_S"))
        except (RayError, GetTimeoutError) as err:
            logger.debug("progress update lost: %s", err)


class ProgressBar:
    """The driver's side: one tqdm bar on ``file`` (default stderr) per ``train()`` call, fed by rank 0.

    Raises ``ValueError`` when tqdm is missing. Used by :class:`~raysgd.TorchTrainer` as
    ``start()``, then ``tick()`` while waiting, then ``finish()``; ``close()`` at shutdown.

    Example:
        >>> import io
        >>> bar = ProgressBar(file=io.StringIO())
        >>> reporter = bar.start(local=True)  # rank 0 in this process: no mailbox actor
        >>> reporter.begin(total=2)
        >>> reporter(0, {"train_loss": 0.5}, {"epoch_idx": 0, "num_epochs": 4}); reporter.end()
        >>> bar.finish()
        >>> bar.last_state["desc"], bar.last_state["pushes"]
        ('1/4e', 2)
    """

    def __init__(self, file=None, interval_s=None):
        require_tqdm()
        self._file = file
        self._interval_s = interval_s
        self._mailbox = None
        self._local = True
        self._call = 0
        self._bar = None
        self._pending = None
        self._local_pushes = 0
        #: The last state shown (``pushes`` counts the updates rank 0 sent during the call).
        self.last_state = None

    def start(self, local):
        """Begin one ``train()`` call; returns the :class:`ProgressReporter` to hand to rank 0."""
        self._close_bar()
        self._call += 1
        self._local = local
        self._pending = None
        self._local_pushes = 0
        self.last_state = None
        if not local and self._mailbox is None:
            self._mailbox = Mailbox()
        sink = self._receive if local else _MailboxSink(self._mailbox)
        return ProgressReporter(sink, self._call, self._interval_s)

    def tick(self):
        """Show the mailbox's latest state once a read has arrived; never waits (the worker group's ``on_tick``)."""
        if self._local or self._mailbox is None:
            return
        try:
            if self._pending is None:
                self._pending = self._mailbox.read()
            ready, _ = ray.wait([self._pending], timeout=0)
            if ready:
                self._pending = None
                self._show_posted(ray.get(ready[0]))
        except RayError as err:
            self._pending = None
            logger.debug("progress read failed: %s", err)

    def finish(self, completed=True):
        """End the call: show rank 0's final state (a bounded wait) when it ``completed``; close the bar."""
        if completed and not self._local and self._mailbox is not None:
            try:
                timeout_s = environment.get("SGD_PROGRESS_FINAL_TIMEOUT_S")
                self._show_posted(ray.get(self._mailbox.read(), timeout=timeout_s))
            except (RayError, GetTimeoutError) as err:
                logger.debug("final progress read failed: %s", err)
        self._close_bar()

    def close(self):
        """Close the bar and stop the mailbox actor."""
        self._close_bar()
        mailbox, self._mailbox = self._mailbox, None
        if mailbox is not None:
            try:
                mailbox.close()
            except Exception as err:  # noqa: BLE001 (already gone with the cluster)
                logger.debug("progress mailbox close failed: %s", err)

    # ----------------------------------------------------------------- internals
    def _show_posted(self, posted):
        state, _, posts = posted
        if state is not None:
            self._show(dict(state, pushes=posts))

    def _receive(self, state, final):
        self._local_pushes += 1
        self._show(dict(state, pushes=self._local_pushes))

    def _show(self, state):
        if not state or state.get("call") != self._call or state == self.last_state:
            return  # nothing yet, a late update from an earlier call, or nothing new
        tqdm = optional.require("tqdm", "TorchTrainer(use_tqdm=True)").tqdm  # checked in __init__ already

        self.last_state = state
        if self._bar is None:
            self._bar = tqdm(total=state["total"], desc=state["desc"], unit="batch", leave=True,
                             file=self._file if self._file is not None else sys.stderr, dynamic_ncols=True)
        bar = self._bar
        bar.start_t = time.time() - state["elapsed"]  # tqdm's clock is time.time: the rate is rank 0's
        bar.total = state["total"]
        bar.n = state["n"]
        bar.set_description_str(state["desc"], refresh=False)
        bar.set_postfix({key: f"{value:.4g}" for key, value in state["losses"].items()}, refresh=False)
        bar.refresh()

    def _close_bar(self):
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
