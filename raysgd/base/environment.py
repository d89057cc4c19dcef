"""Every environment variable raysgd reads, in one table: its name, default, check and doc line (:data:`VARIABLES`).

Layer -1 (standard library only). Every module reads a variable through :func:`get`, at the moment it needs the
value (so a test or a running job may change it); a value that fails its check raises a ``ValueError`` naming the
variable, what it expects and what it holds. The docs' table of variables (docs/environment.md) is
:func:`docs_table`, and ``tests/repo/test_repository.py`` checks that no module reads the environment for one of
raysgd's names (``SGD_*``, ``RAYSGD_*``) any other way, and that the docs give the table as it is.

``read by`` says which process reads a variable: the driver's (your script's), or the workers'. On a cluster that
``ray.init()`` starts, the workers inherit the driver's environment at ``ray.init``; on an existing cluster set a
workers' variable in the job's ``runtime_env={"env_vars": {...}}`` or in ``TorchTrainer(initialization_hook=...)``.

Example:
    >>> get("SGD_RESIZE_COOLDOWN_S")
    10.0
    >>> import os; os.environ["SGD_GROW_CHECK_S"] = "soon"
    >>> get("SGD_GROW_CHECK_S")
    Traceback (most recent call last):
    ...
    ValueError: the environment variable SGD_GROW_CHECK_S expects a number of seconds >= 0 ...; got 'soon'
    >>> del os.environ["SGD_GROW_CHECK_S"]
"""
import dataclasses
import logging
import os

from raysgd.base.checks import MAX_TIMEOUT_S, argument_error, is_number

#: Log levels by name (any case), for the ``RAYSGD_*LOG_LEVEL`` variables and :func:`raysgd.set_log_level`;
#: ``OFF``: nothing from raysgd reaches any handler.
LOG_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "WARN": logging.WARNING,
              "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL, "OFF": logging.CRITICAL + 10}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a variable holds: ``expected`` (the docs' and the errors' words) and ``parse(text) -> value``, which
    raises ``ValueError`` for a text it refuses."""

    expected: str
    parse: object


def seconds(minimum=0.0):
    """A number of seconds >= ``minimum``, finite: at most :data:`~raysgd.base.checks.MAX_TIMEOUT_S` (``inf`` or
    ``1e300`` would fail a wait that Ray or a thread takes with it, late: in a restart, at shutdown).

    Example:
        >>> seconds().parse("2.5"), seconds().expected
        (2.5, 'a number of seconds >= 0 (finite: at most 9223372036)')
    """
    def parse(text):
        value = float(text)
        if not is_number(value, minimum, maximum=MAX_TIMEOUT_S):  # NaN too
            raise ValueError(text)
        return value
    return Kind(f"a number of seconds >= {minimum:g} (finite: at most {MAX_TIMEOUT_S:.0f})", parse)


def count(minimum=1):
    """A whole number >= ``minimum`` (written as an int, or as a float with no fraction: ``1e6``).

    Example:
        >>> count().parse("16777216"), count().parse("1e3")
        (16777216, 1000)
    """
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            number = float(text)
            if not number.is_integer():
                raise
            value = int(number)
        if value < minimum:
            raise ValueError(text)
        return value
    return Kind(f"an int >= {minimum}", parse)


def flag():
    """On or off: ``1``, ``true``, ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off`` (any case).

    Example:
        >>> flag().parse("0"), flag().parse("True")
        (False, True)
    """
    def parse(text):
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(text)
    return Kind("1 or 0 (true/false, yes/no, on/off)", parse)


def level():
    """A log level: a name of :data:`LOG_LEVELS` (any case) or a number; the number.

    Example:
        >>> level().parse("warning"), level().parse("15")
        (30, 15)
    """
    def parse(text):
        if text.upper() in LOG_LEVELS:
            return LOG_LEVELS[text.upper()]
        return int(text)
    return Kind(f"a level name ({', '.join(n for n in LOG_LEVELS if n != 'WARN')}) or a number", parse)


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: ``name``, ``default`` (the value when unset or empty), ``kind``, ``doc`` (the docs'
    line), ``read_by`` (``"driver"``, ``"workers"`` or both) and ``shown``: the docs' default when not ``default``."""

    name: str
    default: object
    kind: Kind
    doc: str
    read_by: str = "driver"
    shown: str | None = None


_BOTH = "driver and workers"
#: Every variable raysgd reads, by name (the docs' order: this one).
VARIABLES = {v.name: v for v in [
    # ----------------------------------------------------------------- starting, placing and stopping workers
    Variable("SGD_PLACEMENT_GROUP_TIMEOUT_S", 100.0, seconds(),
             "how long the workers' placement group may take to be placed (the minimum of an elastic range: then a "
             "`TimeoutError` naming the free resources); a Tune trial's bundles may stay unplaced twice that long"),
    Variable("SGD_PLACEMENT_TRY_S", 3.0, seconds(),
             "how long a start or restart waits for a size above the minimum, or for spares' bundles, before it takes "
             "the size that fits now"),
    Variable("SGD_DYING_NODE_WAIT_S", 30.0, seconds(),
             "how long a restart waits for Ray to report dead a node whose raylet is gone (no worker is placed there)"),
    Variable("SGD_SHUTDOWN_TIMEOUT_S", 10.0, seconds(),
             "how long `shutdown()` gives the workers to end before they are killed"),
    # ----------------------------------------------------------------- failures and resizes
    Variable("SGD_MAX_RESTART_TRIES", 10, count(),
             "how many times a restart tries to start workers before it gives up"),
    Variable("SGD_BACKOFF_CAP_S", 60.0, seconds(), "the cap of the exponential backoff between two restart tries"),
    Variable("SGD_KEEP_SURVIVORS", True, flag(),
             "whether the workers that survive a failure keep their processes (0: every failure restarts every "
             "worker)"),
    Variable("SGD_SURVIVOR_GRACE_S", 2.0, seconds(),
             "how long a survivor's call gets to end with an error after a worker died"),
    Variable("SGD_SNAPSHOT_FINISH_S", 120.0, seconds(),
             "before a failed call's workers are killed, how long rank 0 gets to finish storing the restart point "
             "(the state at the call's start) it serialises beside the call"),
    Variable("SGD_RESIZE_COOLDOWN_S", 10.0, seconds(),
             "seconds after a resize before the group may grow back towards `num_workers`"),
    Variable("SGD_GROW_CHECK_S", 2.0, seconds(),
             "seconds between two checks for room to grow while a committing call trains"),
    Variable("SGD_DRAIN_CHECK_S", 1.0, seconds(),
             "seconds between two checks for draining nodes while a committing call trains"),
    Variable("SGD_RESIZE_ASK_S", 5.0, seconds(),
             "how long a rank may take to answer a request to stop (to grow or move) before it is asked again"),
    Variable("SGD_SPARE_WARM_S", 120.0, seconds(),
             "a warm spare not ready by then (never placed, or stuck) is killed and another started in its bundle"),
    Variable("SGD_SPARE_REFILL_DELAY_S", 1.0, seconds(),
             "how long after a spare took a rank its replacement starts"),
    # ----------------------------------------------------------------- commits and preemption
    Variable("SGD_COMMIT_INTERVAL_S", 30.0, seconds(),
             "seconds of training between two commits inside an epoch with `commit_every_n_steps=None`"),
    Variable("SGD_PREEMPT_CHECK_STEPS", 1, count(),
             "step boundaries between two agreements on a SIGTERM or a request to stop (1: every step)", "workers"),
    Variable("SGD_PREEMPT_GRACE_S", 20.0, seconds(),
             "how long a worker sent SIGTERM waits for the agreed step boundary before it exits anyway (keep it "
             "below your platform's grace period)", "workers"),
    Variable("SGD_PREEMPT_COMMIT_S", 120.0, seconds(),
             "how long the commit agreed after a SIGTERM or a request to stop may take to be stored before the ranks "
             "end the call anyway", "workers"),
    Variable("SGD_CHECKPOINT_FLUSH_S", 600.0, seconds(),
             "how long `shutdown()` waits for the last `storage_path` checkpoint to be stored"),
    # ----------------------------------------------------------------- data and progress
    Variable("SGD_MAX_CURSOR_POSITIONS", 2 ** 24, count(),
             "the longest epoch (sampler positions) drawn whole for the data cursor; a longer or endless sampler "
             "is sharded lazily, without commits inside its epochs", _BOTH, shown="2**24"),
    Variable("SGD_DATA_NO_CPU_S", 10.0, seconds(),
             "how long `train(dataset=...)` waits for a worker's first batch when the workers leave Ray Data no CPU; "
             "then a `TimeoutError` says what to free", _BOTH),
    Variable("SGD_PROGRESS_INTERVAL_S", 0.5, seconds(),
             "least seconds between two progress updates rank 0 sends (`use_tqdm=True`)"),
    Variable("SGD_PROGRESS_FINAL_TIMEOUT_S", 5.0, seconds(),
             "the deadline of rank 0's last progress update of an epoch, and of the driver's last read of it", _BOTH),
    # ----------------------------------------------------------------- logging and imports
    Variable("RAYSGD_LOG_LEVEL", None, level(),
             "what raysgd logs in the driver (a bad value is logged and the default kept); see Logging", _BOTH,
             shown="`INFO`"),
    Variable("RAYSGD_WORKER_LOG_LEVEL", None, level(),
             "what raysgd logs in the workers: by default `WARNING`, the driver's level where that is higher, "
             "`DEBUG` with `DEBUG`", "workers", shown="(see meaning)"),
    Variable("RAYSGD_LEGACY_IMPORTS", False, flag(),
             "set by `raysgd.compat.install()`: `import raysgd` maps `ray.util.sgd` onto raysgd (the workers get it "
             "from the driver)", _BOTH),
    Variable("RAYSGD_TRAIN_IMPORTS", False, flag(),
             "set by `raysgd.compat.install_train()`: `import raysgd` maps `ray.train` onto `raysgd.train`", _BOTH),
    Variable("NCCL_TIMEOUT_S", 1800.0, seconds(),
             "RaySGD 1.x's name, read only by `raysgd.torch.constants.NCCL_TIMEOUT_S`: the process groups' timeout is "
             "`TorchTrainer(timeout_s=...)`"),
]}


def variable(name):
    """The :class:`Variable` ``name``; ``KeyError`` saying where to add one that is not in the table.

    Example:
        >>> variable("SGD_GROW_CHECK_S").default
        2.0
    """
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not one of raysgd's environment variables: add it to "
                       f"raysgd.base.environment.VARIABLES (its default, check and doc line)") from None


def raw(name):
    """The text of variable ``name`` (stripped), or None when it is unset or empty: to hand it on as it was given.

    Example:
        >>> raw("A_VARIABLE_SURELY_UNSET") is None
        True
    """
    text = os.environ.get(name, "").strip()
    return text or None


def get(name):
    """The value of variable ``name`` now: its default when it is unset or empty, else its text checked and parsed
    (a ``ValueError`` naming the variable, what it expects and what it holds).

    Example:
        >>> get("SGD_KEEP_SURVIVORS"), get("SGD_MAX_RESTART_TRIES")
        (True, 10)
    """
    known = variable(name)
    text = raw(name)
    if text is None:
        return known.default
    try:
        return known.kind.parse(text)
    except ValueError as err:
        raise argument_error(f"the environment variable {name}", known.kind.expected, text) from err


def docs_table():
    """The table of docs/environment.md (Markdown): one row per variable, its default, what it takes, which process
    reads it and its doc line.

    Example:
        >>> docs_table().splitlines()[0]
        '| variable | default | takes | read by | meaning |'
    """
    rows = ["| variable | default | takes | read by | meaning |", "|---|---|---|---|---|"]
    for v in VARIABLES.values():
        default = v.shown or (f"{v.default:g}" if isinstance(v.default, float) else
                              str(int(v.default)) if isinstance(v.default, bool) else str(v.default))
        rows.append(f"| `{v.name}` | {default} | {v.kind.expected} | {v.read_by} | {v.doc} |")
    return "\n".join(rows)
