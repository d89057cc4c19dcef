"""Runs an unmodified RaySGD 1.x script with ``ray.util.sgd`` mapped to raysgd.

Outside the layers: imports :mod:`raysgd.compat` and the standard library.
``python -m raysgd.legacy script.py [args]`` installs the mapping (:func:`raysgd.compat.install`; with
``--train`` first, also Ray Train's ``ray.train``/``ray.train.torch``/``ray.train.lightning`` -> ``raysgd.train``:
:func:`raysgd.compat.install_train`),
then runs ``script.py`` as ``__main__`` with ``sys.argv == ["script.py", *args]`` and the script's
directory first on ``sys.path``, as ``python script.py [args]`` would. ``-m module`` runs a module
instead (a 1.x module name such as ``ray.util.sgd.torch.examples.train_example`` works). The script's
``multiprocessing`` children (spawn, forkserver: they run its imports again) get the mapping too.

Example:
    $ python -m raysgd.legacy my_raysgd1_script.py --num-workers 2
    $ python -m raysgd.legacy -m ray.util.sgd.torch.examples.train_example --num-workers 2
    $ python -m raysgd.legacy --train examples/ray_train_guide.py --smoke-test

The ``raysgd run --legacy`` and ``raysgd run --train`` commands (:mod:`raysgd.cli`) are the same.
"""
import argparse
import functools
import os
import runpy
import sys

from raysgd import compat

_USAGE = "python -m raysgd.legacy [--train] (script.py | -m module) [args ...]"


def parse_program(argv, prog="python -m raysgd.legacy", usage=_USAGE):
    """``Namespace(module, script, args)`` of ``argv`` (``script.py [args ...]`` or ``-m module [args ...]``): what
    to run and its arguments. A missing or unreadable script is a usage error (``SystemExit(2)`` naming it)."""
    parser = argparse.ArgumentParser(
        prog=prog, usage=usage,
        description="Run a RaySGD 1.x program unchanged: imports from ray.util.sgd resolve to raysgd.")
    parser.add_argument("-m", dest="module", metavar="module", help="run a module as __main__ (like python -m)")
    parser.add_argument("script", nargs="?", help="the script to run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script as sys.argv[1:]")
    if argv and argv[0] == "-m" and len(argv) >= 2:  # everything after the module name belongs to it
        return argparse.Namespace(module=argv[1], script=None, args=list(argv[2:]))
    if argv and argv[0].startswith("-m") and len(argv[0]) > 2:  # -mmodule, as python -mmodule
        return argparse.Namespace(module=argv[0][2:], script=None, args=list(argv[1:]))
    options = parser.parse_args(argv)
    if options.module is not None:
        parser.error(f"-m must come first: {usage}")
    if options.script is None:
        parser.error(f"expected a script path or -m module; got no arguments. Usage: {usage}")
    if not os.path.isfile(options.script):
        parser.error(f"expected a path to a Python script; got {options.script!r}, which is not a file")
    return options


class _MappingInChild:
    """Unpickled by a ``multiprocessing`` child (spawn, forkserver: a ``Pool``, a ``DataLoader``'s workers) with its
    preparation data, before the child runs the script's imports again: installs the mapping there too (the child
    inherits ``RAYSGD_LEGACY_IMPORTS``, not the finder; without it ``import ray.util.sgd`` raised Ray's
    ``DeprecationWarning`` in every child, and a ``Pool`` restarted them for ever)."""

    def __reduce__(self):
        return compat.install_if_requested, ()


def _map_in_multiprocessing_children():
    """Make every ``multiprocessing`` child started from now on install the mapping first (idempotent)."""
    from multiprocessing import spawn  # noqa: PLC0415

    original = spawn.get_preparation_data
    if getattr(original, "raysgd_mapping", False):
        return

    @functools.wraps(original)
    def get_preparation_data(name):
        data = original(name)
        data["raysgd_mapping"] = _MappingInChild()  # a key multiprocessing's prepare() ignores
        return data

    get_preparation_data.raysgd_mapping = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def run_program(program, legacy=True, train=False):
    """Run ``program`` (from :func:`parse_program`) as ``__main__``, as ``python script.py [args]`` (or ``python -m``)
    would, with ``ray.util.sgd`` mapped to raysgd (``legacy``) and, with ``train``, also Ray Train's ``ray.train``
    names (:func:`raysgd.compat.install_train`). Exceptions from the program propagate, ``SystemExit`` included."""
    if legacy or train:
        compat.install()
    if train:
        compat.install_train()
    if legacy or train:
        _map_in_multiprocessing_children()
    if program.module is not None:
        module = program.module
        if (legacy or train) and compat.translate(module) is not None:
            # a removed or unknown 1.x path raises ModuleNotFoundError saying what replaced it or what exists
            compat.LegacyFinder().find_spec(module)
            module = compat.translate(module)
        sys.argv = [program.module, *program.args]
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(program.script)
    sys.argv = [program.script, *program.args]
    script_dir = os.path.dirname(script)
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = script_dir  # python -m put the cwd there; python script.py puts the script's directory
    else:
        sys.path.insert(0, script_dir)
    runpy.run_path(script, run_name="__main__")


def main(argv=None):
    """Run a script (or ``-m`` module) as ``__main__`` with the legacy mapping installed.

    ``argv`` defaults to ``sys.argv[1:]``. Exceptions from the script propagate, including
    ``SystemExit`` with its exit code.

    Example:
        >>> main(["path/to/legacy_script.py", "--smoke-test"])  # doctest: +SKIP
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    train = bool(argv) and argv[0] == "--train"  # Ray Train's names too (before the script's own arguments)
    run_program(parse_program(argv[1:] if train else argv), legacy=True, train=train)


if __name__ == "__main__":
    main()
