"""What a user sees without configuring logging: raysgd's own lines on stderr, one line per event, and how to quiet them.

Layer 0: the standard library only. ``import raysgd`` calls :func:`install`: the ``raysgd`` logger gets a level
(``RAYSGD_LOG_LEVEL``, default ``INFO``) and one :class:`ConsoleHandler` that writes to ``sys.stderr`` only while no
other handler would take the record: with logging left unconfigured (most scripts) raysgd's warnings and its few
INFO lines (a restart and from where, the workers now, a resume from a checkpoint, spares ready) are seen; once the
program configures logging (``logging.basicConfig``, ``dictConfig``, a handler on ``raysgd``, pytest's capture) its
handlers print them instead, never both. Records always propagate to the root logger.

A worker process (an actor of the worker group or a warm spare: :func:`as_worker`) prints WARNING and above
(``RAYSGD_WORKER_LOG_LEVEL``), which Ray forwards to the driver's stderr under the actor's name: a lost peer or a
SIGTERM is seen, per-rank chatter is not. The worker group passes the driver's levels to each actor it starts where
they differ from the defaults (:func:`forwarded_env`), so :func:`set_log_level` reaches the workers started after it.

Levels are names (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``, ``CRITICAL``, ``OFF``) or numbers.

Example:
    >>> import logging
    >>> set_log_level("WARNING")
    >>> logging.getLogger("raysgd").level == logging.WARNING
    True
    >>> set_log_level("INFO")
"""
import logging
import sys

from raysgd.base import environment
from raysgd.base.checks import argument_error, is_int

#: The driver's level (default ``INFO``): what ``raysgd`` logs and the console shows in this process.
LEVEL_ENV = "RAYSGD_LOG_LEVEL"
#: The level of worker processes (default: ``WARNING``, or the driver's level where that is higher or ``DEBUG``).
WORKER_LEVEL_ENV = "RAYSGD_WORKER_LOG_LEVEL"
#: The variables the worker group forwards to its actors.
FORWARDED_ENV = (LEVEL_ENV, WORKER_LEVEL_ENV)
#: Level names (any case): the standard ones, and ``OFF``: nothing from raysgd reaches the console (or any handler).
NAMES = environment.LOG_LEVELS
OFF = NAMES["OFF"]
FORMAT = "%(asctime)s raysgd %(levelname)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"

logger = logging.getLogger("raysgd")


def parse_level(level, what="set_log_level(level)"):
    """A level given as a name (any case) or a number (a numpy int too, or its text: ``"15"``, as
    ``RAYSGD_LOG_LEVEL`` takes it and :func:`forwarded_env` hands it on), as an int; ``ValueError`` naming ``what``
    otherwise.

    Example:
        >>> parse_level("warning"), parse_level(10), parse_level("15"), parse_level("off") > logging.CRITICAL
        (30, 10, 15, True)
    """
    if is_int(level):
        return int(level)
    if isinstance(level, str):
        try:
            return environment.level().parse(level.strip())
        except ValueError as err:
            raise argument_error(what, environment.level().expected, level) from err
    raise argument_error(what, environment.level().expected, level)


def worker_level(level):
    """The default level of worker processes for the driver's ``level``: WARNING (per-rank INFO lines would repeat
    on every rank), ``level`` where that is higher (quieter), and ``DEBUG`` when the driver is at ``DEBUG``.

    Example:
        >>> [logging.getLevelName(worker_level(n)) for n in (logging.DEBUG, logging.INFO, logging.ERROR)]
        ['DEBUG', 'WARNING', 'ERROR']
    """
    return level if level <= logging.DEBUG or level > logging.WARNING else logging.WARNING


class ConsoleHandler(logging.StreamHandler):
    """raysgd's line on ``sys.stderr`` (the stream of the moment, so a redirect is followed), written only when no
    other handler on the record's way up (the ``raysgd`` loggers, then the root, as far as ``propagate`` goes) would
    handle it: a program that configured logging sees each line once, through its own handlers."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it: the stream of the moment is used instead
        pass

    def others_handle(self, record):
        """Whether a handler other than this one (of any kind, a ``NullHandler`` included) would get ``record``."""
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            if any(handler is not self for handler in current.handlers):
                return True
            if not current.propagate:
                return False
            current = current.parent
        return False

    def handle(self, record):
        if self.others_handle(record):
            return False
        return super().handle(record)


def _console():
    return next((h for h in logger.handlers if isinstance(h, ConsoleHandler)), None)


def _from_env(name, default, given=None):
    """The level of variable ``name``: ``given`` (its value handed on by the driver), else this process's
    environment, else ``default``; a bad value is logged and ``default`` kept (a worker never fails to start for
    it)."""
    try:
        if str(given if given is not None else "").strip():
            value = parse_level(given, what=f"the environment variable {name}")
        else:
            value = environment.get(name)
    except ValueError as err:
        logger.warning("%s; using %s", err, logging.getLevelName(default))
        return default
    return default if value is None else value


def install():
    """Give the ``raysgd`` logger its level and console handler (once per process; :func:`set_log_level` changes
    them). A level already set on the ``raysgd`` logger by the program is kept unless ``RAYSGD_LOG_LEVEL`` is set.

    Example:
        >>> install() is install()
        True
    """
    console = _console()
    if console is None:
        console = ConsoleHandler()
        logger.addHandler(console)
        default = logger.level if logger.level != logging.NOTSET else logging.INFO
        logger.setLevel(_from_env(LEVEL_ENV, default))
    return console


def _name(level):
    return next((name for name, number in NAMES.items() if number == level and name != "WARN"), str(level))


_workers = {"level": None}  # the workers' level set_log_level gave (None: RAYSGD_WORKER_LOG_LEVEL or the default)


def set_log_level(level, workers=None):
    """Set what raysgd logs: ``level`` in this process, ``workers`` in the worker processes started from now on
    (default: WARNING, ``level`` where that is higher, or ``DEBUG`` with ``DEBUG``; the worker group passes both to
    the actors it starts). Equivalent to ``RAYSGD_LOG_LEVEL`` and ``RAYSGD_WORKER_LOG_LEVEL``.

    ``"WARNING"`` hides the INFO lines (restarts, resizes, resumes, spares ready); ``"ERROR"`` hides the warnings
    too; ``"OFF"`` hides everything; ``"DEBUG"`` shows the details, on the workers too.

    Example:
        >>> import raysgd
        >>> raysgd.set_log_level("WARNING")  # only warnings and errors from raysgd
        >>> raysgd.set_log_level("INFO")     # the default
    """
    number = parse_level(level)
    worker_number = None if workers is None else parse_level(workers, "set_log_level(workers=...)")
    install()
    logger.setLevel(number)
    _workers["level"] = worker_number


def current_levels():
    """``(level, workers)`` as :func:`set_log_level` takes them: what raysgd logs now in this process and in the
    workers it starts (to put back after a temporary change).

    Example:
        >>> set_log_level("ERROR"); current_levels()
        ('ERROR', None)
        >>> set_log_level(*("INFO", None))
    """
    level = logger.level if logger.level != logging.NOTSET else logging.INFO
    workers = _workers["level"]
    return _name(level), (_name(workers) if workers is not None else None)


def as_worker(levels=None):
    """Make this process log as a worker: the ``raysgd`` logger at ``RAYSGD_WORKER_LOG_LEVEL`` (default: from
    ``RAYSGD_LOG_LEVEL`` by :func:`worker_level`), each read from ``levels`` (the driver's :func:`forwarded_env`, which
    the worker group passes to each actor it starts) before this process's environment. Called by each worker actor
    when it starts.

    Example:
        >>> # in a worker process: as_worker({}); logging.getLogger("raysgd").level == logging.WARNING
    """
    install()
    levels = levels or {}
    driver = _from_env(LEVEL_ENV, logging.INFO, levels.get(LEVEL_ENV))
    logger.setLevel(_from_env(WORKER_LEVEL_ENV, worker_level(driver), levels.get(WORKER_LEVEL_ENV)))


def forwarded_env():
    """``{name: value}`` of the log levels to hand the worker actors this process starts (:func:`as_worker`): those
    that differ from the defaults (or that the environment sets).

    Example:
        >>> forwarded_env()
        {}
        >>> set_log_level("ERROR"); forwarded_env()
        {'RAYSGD_LOG_LEVEL': 'ERROR'}
        >>> set_log_level("INFO", workers="DEBUG"); forwarded_env()
        {'RAYSGD_WORKER_LOG_LEVEL': 'DEBUG'}
        >>> set_log_level("INFO")
    """
    found = {}
    level = logger.level if logger.level != logging.NOTSET else logging.INFO
    if level != logging.INFO or environment.raw(LEVEL_ENV) is not None:
        found[LEVEL_ENV] = _name(level)
    workers = _workers["level"]
    if workers is not None:
        found[WORKER_LEVEL_ENV] = _name(workers)
    elif environment.raw(WORKER_LEVEL_ENV) is not None:
        found[WORKER_LEVEL_ENV] = environment.raw(WORKER_LEVEL_ENV)
    return found
