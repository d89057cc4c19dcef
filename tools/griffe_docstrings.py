"""Griffe extension for the API reference: raysgd's docstrings, written for Sphinx and doctest, read well in MkDocs.

Two rewrites, made before a docstring is parsed:

- ``Example:`` headings become ``Examples:``: Griffe's Google parser knows only the plural as a section and would
  render the singular as a Markdown admonition, each ``>>>`` line a quote.
- Sphinx roles (``:class:`~raysgd.meters.AverageMeter```, ``:meth:`save```, ``:mod:`...```) become inline code
  (``AverageMeter``, ``save``): Markdown shows a role as its raw text.

Loaded by mkdocstrings (mkdocs.yml), never by raysgd.
"""
import re

import griffe

HEADING = re.compile(r"^(\s*)Example:\s*$", flags=re.M)
ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _role(match):
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def rewrite(text):
    """The docstring ``text`` with ``Examples:`` headings and roles as inline code.

    Example:
        >>> rewrite("See :class:`~raysgd.meters.AverageMeter` and :meth:`save`.")
        'See `AverageMeter` and `save`.'
    """
    return ROLE.sub(_role, HEADING.sub(r"\1Examples:", text))


class DocstringRewrites(griffe.Extension):
    """Apply :func:`rewrite` to every docstring Griffe loads."""

    def on_instance(self, *, obj, **kwargs):
        """Called by Griffe for every object it loads."""
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
