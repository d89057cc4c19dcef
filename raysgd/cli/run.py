"""``raysgd run [--legacy | --train] (script.py | -m module) [args ...]``: run a program as ``python script.py`` would.

Part of :mod:`raysgd.cli`, over :mod:`raysgd.legacy`'s :func:`~raysgd.legacy.run_program`:

- no flag: the program as it is (raysgd's console lines on, as for any program that imports raysgd);
- ``--legacy``: a RaySGD 1.x program unchanged: ``ray.util.sgd`` imports resolve to raysgd (what
  ``python -m raysgd.legacy script.py`` does);
- ``--train``: also Ray Train's ``ray.train``, ``ray.train.torch`` and ``ray.train.lightning`` names resolve to
  :mod:`raysgd.train` (``python -m raysgd.legacy --train``).

``--log-level LEVEL`` sets raysgd's log level first (:func:`raysgd.set_log_level`). Everything after the script (or
the module's name) is the program's own ``sys.argv[1:]``; its exit status and exceptions are its own.

Example:
    $ raysgd run --legacy my_raysgd1_script.py --num-workers 2
    $ raysgd run --train examples/ray_train_guide.py --smoke-test
    $ raysgd run --log-level WARNING examples/fault_tolerance.py --smoke-test
"""
import argparse

from raysgd import legacy, logs

USAGE = "raysgd run [--legacy | --train] [--log-level LEVEL] (script.py | -m module) [args ...]"


def add_parser(commands, name):
    parser = commands.add_parser(
        name, usage=USAGE, help="run a Python program (a RaySGD 1.x one with --legacy, Ray Train's with --train)",
        description="Run script.py (or -m module) as __main__, as python would, with its arguments. --legacy maps "
                    "RaySGD 1.x's ray.util.sgd imports to raysgd (the program runs unchanged); --train also maps Ray "
                    "Train's ray.train, ray.train.torch and ray.train.lightning to raysgd.train.")
    mapping = parser.add_mutually_exclusive_group()
    mapping.add_argument("--legacy", action="store_true", help="map ray.util.sgd to raysgd (RaySGD 1.x programs)")
    mapping.add_argument("--train", action="store_true", help="also map ray.train to raysgd.train (Ray Train programs)")
    parser.add_argument("--log-level", metavar="LEVEL", type=_level,
                        help="raysgd's log level: DEBUG, INFO (the default), WARNING, ERROR or OFF")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py | -m module",
                        help="the program and its arguments")


def split_argv(argv):
    """``(options, program)`` of ``raysgd run``'s arguments: its own options (``--legacy``, ``--train``, ``--log-level
    LEVEL``, ``--help``) up to the program, and the program with its arguments (``script.py ...`` or ``-m module
    ...``), which argparse alone would take ``-m`` of for an option of ``raysgd run``.

    Example:
        >>> split_argv(["--legacy", "-m", "my_module", "--epochs", "2"])
        (['--legacy'], ['-m', 'my_module', '--epochs', '2'])
    """
    argv = list(argv)
    for index, token in enumerate(argv):
        if token == "--log-level" and index + 1 < len(argv):
            continue  # its value follows
        if index and argv[index - 1] == "--log-level":
            continue
        if token not in ("--legacy", "--train", "-h", "--help", "--log-level") and not token.startswith("--log-level="):
            return argv[:index], argv[index:]
    return argv, []


def _level(text):
    try:
        logs.parse_level(text, what="--log-level")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return text


def main(options):
    """Run ``options.program`` (see the module docstring)."""
    program = legacy.parse_program(options.program, prog="raysgd run", usage=USAGE)
    if options.log_level is not None:
        logs.set_log_level(options.log_level)
    legacy.run_program(program, legacy=options.legacy, train=options.train)
    return 0
