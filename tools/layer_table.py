"""The layer tables of docs/architecture.md, read: the one source of raysgd's layers.

``tests/repo/test_layers.py`` checks the package's imports against them and ``tools/draw_architecture.py`` draws them;
the page shows them to the reader. Three tables, each found by its header row:

- ``| layer | may import beyond the standard library | ... |``: what each layer's units may import (``anything``
  for the package glue, ``nothing`` for the standard library alone);
- ``| unit | layer | ... |``: every unit (a folder of ``raysgd/torch`` or of ``raysgd/``, or a module) and its layer;
- ``| module | may import beyond the standard library | ... |``: modules held lighter than their layer allows (the
  pure policies are tested without Ray or torch).

A layer is a number, or ``glue`` (:data:`GLUE`): the packages' public names and RaySGD 1.x's paths, which import
anything. Names are written as code (`` `raysgd.torch.state` ``), lists comma-separated.

Example:
    >>> tables = read()
    >>> tables.units["raysgd.torch.state"], tables.units["raysgd"] == GLUE, tables.allowed[-1]
    (2, True, set())
"""
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
#: The layer of the package glue (above the facades, below the command line, which nothing imports).
GLUE = 8

#: ``units``: {unit: layer}; ``allowed``: {layer: the third-party packages it may import, or None for anything};
#: ``lighter``: {module: the third-party packages it may import}.
Tables = collections.namedtuple("Tables", "units allowed lighter")


def _rows(text, header):
    """The cells of each row of the Markdown table whose header row starts with ``header``'s cells."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:len(header)] == header:
            break
    else:
        raise ValueError(f"{PAGE.name} has no table headed {' | '.join(header)}")
    rows = []
    for line in lines[start + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _names(cell):
    """The code names of a cell (`` `a`, `b` ``), or an empty set for ``nothing``; None for ``anything``."""
    if cell == "anything":
        return None
    return set(re.findall(r"`([^`]+)`", cell))


def _layer(cell):
    return GLUE if cell == "glue" else int(cell)


def read(page=PAGE):
    """The three tables of ``page`` (see the module docstring)."""
    text = pathlib.Path(page).read_text()
    allowed = {_layer(row[0]): _names(row[1]) for row in _rows(text, ["layer", "may import beyond the standard library"])}
    units = {}
    for row in _rows(text, ["unit", "layer"]):
        for unit in _names(row[0]):
            units[unit] = _layer(row[1])
    lighter = {}
    for row in _rows(text, ["module", "may import beyond the standard library"]):
        for module in _names(row[0]):
            lighter[module] = _names(row[1])
    return Tables(units, allowed, lighter)
