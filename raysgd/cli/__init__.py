"""The ``raysgd`` command: run a program, list a run's checkpoints and check them, export a model for serving.

The outermost layer (the command line): it imports down, nothing imports it. One subcommand per module:

- ``raysgd run [--legacy | --train] (script.py | -m module) [args ...]``: :mod:`raysgd.cli.run`
  (what ``python -m raysgd.legacy`` does, and a plain run);
- ``raysgd checkpoints PATH``: :mod:`raysgd.cli.checkpoints` (each checkpoint's epoch, step, workers, strategy,
  size, and a CRC-32 check naming the damaged ones; ``raysgd.train`` run folders: :mod:`raysgd.cli.train_folders`);
- ``raysgd export PATH OUT``: :mod:`raysgd.cli.export` (the models' weights, consolidated, as safetensors).

A path that is not a raysgd checkpoint, or bad arguments, end the command with exit status 2 and one line on stderr
saying what was expected and what was given; a damaged checkpoint found by ``checkpoints`` makes it exit 1, and so
does a read or write that failed (an ``OSError``: a network error or a refusal of object storage, a full disk), with
one line on stderr, not a traceback.

Example:
    >>> main(["--version"])  # doctest: +SKIP
    raysgd 0.1.0
    $ raysgd checkpoints /data/runs/mnist
    $ raysgd export /data/runs/mnist model.safetensors
"""
import argparse
import sys

import raysgd
from raysgd.cli import checkpoints, export, run
from raysgd.cli.paths import BadArgument, NotACheckpoint
from raysgd.optional import MissingExtra
from raysgd.torch.errors import CheckpointError

COMMANDS = {"run": run, "checkpoints": checkpoints, "export": export}


def parser():
    """The command's argument parser (each subcommand's module adds its own)."""
    top = argparse.ArgumentParser(
        prog="raysgd", description="raysgd's command line: run a program, inspect a run's checkpoints, export "
                                   "weights. 'raysgd COMMAND --help' describes each command.")
    top.add_argument("--version", action="version", version=f"raysgd {raysgd.__version__}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.add_parser(commands, name)
    return top


def main(argv=None):
    """Run the ``raysgd`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> main(["checkpoints", "/no/such/folder"])  # doctest: +SKIP
        2
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    top = parser()
    program = None
    if argv and argv[0] == "run":  # the program's own arguments (and -m module) are never raysgd run's options
        own, program = run.split_argv(argv[1:])
        argv = ["run", *own]
    options = top.parse_args(argv)
    if program is not None:
        options.program = program
    if options.command is None:
        top.print_help(sys.stderr)
        return 2
    if options.command == "run":  # the program's own errors and exit status are its own: never caught here
        return run.main(options) or 0
    try:
        return COMMANDS[options.command].main(options) or 0
    except (NotACheckpoint, BadArgument, CheckpointError, MissingExtra, FileExistsError) as err:
        sys.stderr.write(f"raysgd {options.command}: error: {err}\n")
        return 2
    except OSError as err:  # reading or writing failed: a network error or a refusal (S3), a full disk ...
        sys.stderr.write(f"raysgd {options.command}: error: {type(err).__name__}: {err}\n")
        return 1
