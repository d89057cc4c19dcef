"""Print the requirements of one of setup.py's extras, one per line, read from setup.py without running it.

    python3 .ci/extra_requirements.py docs    # mkdocs>=1.6, mkdocs-material>=9.5, mkdocstrings[python]>=0.26

.ci/run installs the docs extra's packages into a folder of their own (``pip install --target``), so the
documentation builds beside the tests without adding a package to the tests' environment. Standard library only;
tests/repo/test_repository.py checks it against setup.py's ``extras_require``.
"""
import ast
import pathlib
import sys

SETUP_PY = pathlib.Path(__file__).resolve().parent.parent / "setup.py"


def requirements(extra, source=None):
    """The requirements of ``extra`` in ``setup()``'s ``extras_require`` (a literal dict) of ``source``.

    Example:
        >>> requirements("docs", 'setup(name="x", extras_require={"docs": ["mkdocs>=1.6"], "test": ["pytest"]})')
        ['mkdocs>=1.6']
    """
    tree = ast.parse(SETUP_PY.read_text() if source is None else source)
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    extras = ast.literal_eval(next(keyword.value for keyword in call.keywords if keyword.arg == "extras_require"))
    if extra not in extras:
        raise SystemExit(f"setup.py has no extra {extra!r}; its extras: {', '.join(sorted(extras))}")
    return list(extras[extra])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 .ci/extra_requirements.py EXTRA")
    print("\n".join(requirements(sys.argv[1])))
