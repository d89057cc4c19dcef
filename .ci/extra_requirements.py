"""Print the requirements of one of setup.py's extras, one per line, read from setup.py without running it.

    python3 .ci/extra_requirements.py docs    # mkdocs>=1.6, mkdocs-material>=9.5, mkdocstrings[python]>=0.26

.ci/run installs the docs extra's packages into a folder of their own (``pip install --target``), so the
documentation builds beside the tests without adding a package to the tests' environment. Standard library only;
tests/repo/test_repository.py reads setup.py's extras with :func:`extras` too.
"""
import ast
import pathlib
import sys

SETUP_PY = pathlib.Path(__file__).resolve().parent.parent / "setup.py"


def extras(source=None):
    """``{extra: [requirement, ...]}``: ``setup()``'s ``extras_require`` (a literal dict) in ``source`` (setup.py's
    text by default).

    Example:
        >>> extras('setup(name="x", extras_require={"docs": ["mkdocs>=1.6"], "test": ["pytest"]})')["docs"]
        ['mkdocs>=1.6']
    """
    tree = ast.parse(SETUP_PY.read_text() if source is None else source)
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    return ast.literal_eval(next(keyword.value for keyword in call.keywords if keyword.arg == "extras_require"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 .ci/extra_requirements.py EXTRA")
    found = extras()
    if sys.argv[1] not in found:
        raise SystemExit(f"setup.py has no extra {sys.argv[1]!r}; its extras: {', '.join(sorted(found))}")
    print("\n".join(found[sys.argv[1]]))
