"""``python -m raysgd``: the ``raysgd`` command (:mod:`raysgd.cli`), for an environment without its script on PATH.

Example:
    $ python -m raysgd checkpoints /data/runs/mnist
"""
import sys

from raysgd.cli import main

if __name__ == "__main__":
    sys.exit(main())
