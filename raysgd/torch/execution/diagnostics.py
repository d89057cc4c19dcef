"""Hang forensics: the Python stack of every rank, taken while it is stuck.

Layer 5 helper of :mod:`raysgd.torch.execution.worker_group` (which sends the requests). Each worker actor has a second Ray concurrency
group, ``"control"``, whose one thread answers while the default group is busy training (or stuck):
the group sends :func:`format_stacks` there. A rank living in the driver (``use_local``) is read
in-process from its runner thread. When a worker does not answer within the deadline (its process
holds the interpreter lock, or is gone), ``py-spy dump`` is tried on its process if it runs on this
machine (a process that has ended there is reported dead, as Ray reports a dead actor: :data:`DEAD`); otherwise the
text says why no stack could be taken.

Example:
    >>> import threading
    >>> text = format_stacks(only=[threading.get_ident()], skip_current=False)
    >>> "format_stacks" in text and text.startswith("Thread ")
    True
"""
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import traceback

import ray
from ray.exceptions import RayActorError, RayError

from raysgd import optional
from raysgd.torch.errors import first_line

logger = logging.getLogger(__name__)

#: The actor's concurrency group that answers while the default group trains.
CONTROL_GROUP = "control"
#: The actor's concurrency group that serialises the call-start snapshot beside the call
#: (:mod:`raysgd.torch.restart_points.call_start`).
SNAPSHOT_GROUP = "snapshot"
CONCURRENCY_GROUPS = {CONTROL_GROUP: 1, SNAPSHOT_GROUP: 1}
#: Seconds to wait for one rank's stack before giving up on it.
STACK_TIMEOUT_S = 5.0
#: The same when the ranks that did answer saw a peer's connection close: the silent rank's process is most likely
#: gone, and Ray says so only once it sees the death (at once for a process; for a lost node, after its health
#: check, which the recovery must not wait for). A live rank answers from its control group in milliseconds.
PEER_GONE_STACK_TIMEOUT_S = 0.3
#: A rank's "stack" when its process was found dead while the stacks were taken (Ray reported it, or it ended on this
#: machine).
DEAD = "no stack: the worker's process is dead"


def format_stacks(only=None, skip_current=True):
    """Every Python thread's stack in this process, as text (the calling thread left out).

    Args:
        only: thread idents to include (default: all).
        skip_current: leave out the thread calling this (the control thread of a worker).
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    current = threading.get_ident()
    parts = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != current):
        if (skip_current and ident == current) or (only is not None and ident not in only):
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {names.get(ident, 'unnamed')} ({ident}), most recent call last:\n{stack}")
    return "\n".join(parts) if parts else "no Python thread found"


def py_spy_path():
    """The ``py-spy`` program this process can run, or None when it is not installed.

    Example:
        >>> py_spy_path() is None or os.path.exists(py_spy_path())
        True
    """
    candidates = [shutil.which("py-spy"), os.path.join(sysconfig.get_path("scripts"), "py-spy"),
                  os.path.join(os.path.dirname(sys.executable), "py-spy")]
    return next((path for path in candidates if path and os.path.exists(path)), None)


def py_spy_dump(pid, timeout_s=10.0):
    """``py-spy dump --pid`` of a process on this machine: its stacks, or a sentence saying why there are none.

    Example:
        >>> "py-spy" in py_spy_dump(os.getpid()) or "Thread" in py_spy_dump(os.getpid())  # doctest: +SKIP
        True
    """
    binary = py_spy_path()
    if binary is None:
        return f"no stack: py-spy is not installed ({optional.install_hint('py-spy')})"
    try:
        done = subprocess.run([binary, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"no stack: py-spy dump --pid {pid} took longer than {timeout_s:.0f} s"
    except OSError as err:  # not executable, another machine's build: every other rank's stack is still reported
        return f"no stack: {binary} could not be run ({type(err).__name__}: {err.strerror or err})"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        return f"no stack: py-spy dump --pid {pid} failed ({reason[-1] if reason else done.returncode})"
    return "py-spy dump:\n" + done.stdout


def _actor_process(actor_id):
    """``(pid, node ip)`` of an actor, from Ray's actor table; ``(None, None)`` if unknown."""
    from ray._private.state import state  # noqa: PLC0415 (the pid is in the GCS actor table only)

    try:
        entry = state.actor_table(actor_id) or {}
    except Exception:  # noqa: BLE001 (unknown actor)
        return None, None
    return entry.get("Pid"), (entry.get("Address") or {}).get("IPAddress")


def process_ended(pid):
    """Whether process ``pid`` of this machine has ended (gone, or a zombie not yet reaped by its parent).

    Example:
        >>> process_ended(os.getpid())
        False
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")  # the state, after "(command name)"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def stacks_without_answer(actor_id, timeout_s):
    """The stacks of the worker actor ``actor_id`` (hex) that did not answer within ``timeout_s``: a ``py-spy``
    dump of its process when it runs on this machine, or a sentence saying why there is none."""
    pid, ip = _actor_process(actor_id)
    if pid is None:
        return "no stack: the worker's process is unknown to Ray"
    if ip != ray.util.get_node_ip_address():
        return (f"no stack: the worker (pid {pid} on {ip}) did not answer within {timeout_s:.1f} s and runs on "
                f"another machine (run py-spy dump --pid {pid} there)")
    if process_ended(pid):  # killed, and Ray has not said so yet (a process lost with its node: at Ray's verdict)
        return DEAD
    return py_spy_dump(pid)


def gather_stacks(requests, timeout_s=STACK_TIMEOUT_S):
    """``{rank: text}`` from ``{rank: text or (ObjectRef of format_stacks, actor id hex)}``.

    A worker that does not answer within ``timeout_s`` is dumped with py-spy when it runs on this
    machine; a dead one says so.
    """
    stacks = {rank: req for rank, req in requests.items() if isinstance(req, str)}
    refs = {req[0]: (rank, req[1]) for rank, req in requests.items() if not isinstance(req, str)}
    ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)[0] if refs else []
    for ref, (rank, actor_id) in refs.items():
        if ref not in ready:
            stacks[rank] = stacks_without_answer(actor_id, timeout_s)
            continue
        try:
            stacks[rank] = ray.get(ref)
        except RayActorError:
            stacks[rank] = DEAD
        except RayError as err:
            stacks[rank] = f"no stack: {type(err).__name__}: {first_line(err)[:200]}"
    return dict(sorted(stacks.items()))


def describe_stacks(stacks):
    """One block of text per rank, for an error message or a log.

    Example:
        >>> print(describe_stacks({1: 'File "x.py", line 3, in train_batch'}))
        --- rank 1 ---
        File "x.py", line 3, in train_batch
    """
    return "\n".join(f"--- rank {rank} ---\n{text.rstrip()}" for rank, text in sorted(stacks.items()))
