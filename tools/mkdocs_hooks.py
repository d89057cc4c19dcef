"""MkDocs hook: every public name the API reference renders has a docstring, or ``mkdocs build --strict`` fails.

mkdocstrings renders a name without a docstring silently (a heading and a signature), so this hook reads each
``::: target`` of the pages under ``api/`` (with its ``members:`` list when the page gives one), imports the target
and logs a warning for the target, and for each member it renders, that has no docstring of its own. A method that
overrides a documented method of a base class (a Lightning or Ray interface) counts as documented. ``--strict``
turns the warnings into a failed build. Run by ``mkdocs build`` (``hooks:`` in mkdocs.yml), never imported by raysgd.
"""
import importlib
import inspect
import logging
import re

log = logging.getLogger("mkdocs.plugins.raysgd_docstrings")

TARGET = re.compile(r"^::: *([\w.]+)\s*$")
MEMBERS = re.compile(r"^\s+members:\s*\[([^\]]*)\]\s*$")


def _resolve(path):
    """The object a dotted ``path`` names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import {path}")


def _targets(markdown):
    """``(target, members or None)`` for each ``::: target`` block of a page."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        match = TARGET.match(line)
        if not match:
            continue
        members = None
        for option in lines[i + 1:i + 12]:
            if TARGET.match(option) or not option.strip():
                break
            found = MEMBERS.match(option)
            if found:
                members = [m.strip().strip("'\"") for m in found.group(1).split(",") if m.strip()]
        yield match.group(1), members


def _own_doc(obj):
    return (getattr(obj, "__doc__", None) or "").strip()


def _documented_member(cls, name):
    """True when ``cls.name`` has a docstring, its own or that of the base-class method it overrides."""
    raw = inspect.getattr_static(cls, name)
    func = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
    if _own_doc(func):
        return True
    return any(_own_doc(getattr(base, name, None)) for base in cls.__mro__[1:] if name in vars(base))


def _public_members(obj):
    """The names mkdocstrings renders for a module (``__all__``, else what it defines) or a class (its own body)."""
    if inspect.ismodule(obj):
        names = getattr(obj, "__all__", None)
        if names is None:
            names = [n for n, v in vars(obj).items()
                     if not n.startswith("_") and getattr(v, "__module__", None) == obj.__name__
                     and (inspect.isclass(v) or inspect.isfunction(v))]
        return list(names)
    return [n for n, v in vars(obj).items() if not n.startswith("_")
            and (inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod)))]


def undocumented(path, members=None):
    """The dotted names under ``path`` (as a page renders it) that have no docstring."""
    obj = _resolve(path)
    missing = [] if _own_doc(obj) else [path]
    for name in members if members is not None else _public_members(obj):
        if inspect.isclass(obj):
            if not _documented_member(obj, name):
                missing.append(f"{path}.{name}")
            continue
        member = getattr(obj, name)
        if not _own_doc(member):
            missing.append(f"{path}.{name}")
        if inspect.isclass(member) and members is None:
            missing += [f"{path}.{name}.{m}" for m in _public_members(member) if not _documented_member(member, m)]
    return missing


def on_page_markdown(markdown, page, **kwargs):
    """Warn (a failure under ``--strict``) for each rendered public name without a docstring."""
    if not page.file.src_uri.startswith("api/"):
        return markdown
    for target, members in _targets(markdown):
        try:
            names = undocumented(target, members)
        except (ImportError, AttributeError) as err:
            log.warning("%s: cannot import %s for the API reference: %s", page.file.src_uri, target, err)
            continue
        for name in names:
            log.warning("%s: %s has no docstring", page.file.src_uri, name)
    return markdown
