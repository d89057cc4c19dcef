"""Print one of README.md's two set-up commands, so that .ci/run runs exactly what README says.

    python3 .ci/readme_command.py example                  # the first: plain install, then examples/train_linear.py
    python3 .ci/readme_command.py example --wheel W.whl    # the same, installing the wheel W.whl built by CI
    python3 .ci/readme_command.py tests                    # the second: install with the test extra, then pytest

README's first command installs the checkout (``pip install -c constraints.txt .``: pip builds a wheel of it and
installs that, not an editable link). With ``--wheel`` the install target ``.`` is replaced by the wheel
``python -m build`` made, so CI checks the very file it would publish, and nothing else of the command changes.

Standard library only (it runs before any virtual environment exists). tests/repo/test_repository.py
checks that it finds README's commands and that .ci/run runs them.
"""
import pathlib
import re
import shlex
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
#: README's first command installs the checkout with this, followed by " && ".
PLAIN_INSTALL = "pip install -c constraints.txt ."


def setup_commands(text):
    """The ```bash blocks of ``text`` that set up a virtual environment, in order."""
    blocks = re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)
    return [block for block in blocks if block.startswith("python3 -m venv")]


def command(kind, text=None, wheel=None):
    """README's ``example`` or ``tests`` set-up command; SystemExit naming what is wrong when it is not there.

    Example:
        >>> readme = "```bash\\npython3 -m venv .venv && pip install -c constraints.txt . && python x.py\\n```\\n" \\
        ...          "```bash\\npython3 -m venv .venv && pytest\\n```"
        >>> command("example", readme, wheel="dist/raysgd-1.0-py3-none-any.whl")
        'python3 -m venv .venv && pip install -c constraints.txt dist/raysgd-1.0-py3-none-any.whl && python x.py'
    """
    commands = setup_commands(README.read_text() if text is None else text)
    if len(commands) != 2:
        raise SystemExit(f"README.md should hold 2 set-up commands (```bash blocks starting 'python3 -m venv'); "
                         f"found {len(commands)}")
    wanted = {"example": 0, "tests": 1}
    if kind not in wanted:
        raise SystemExit(f"expected 'example' or 'tests'; got {kind!r}")
    found = commands[wanted[kind]]
    if wheel is None:
        return found
    if kind != "example" or found.count(f" {PLAIN_INSTALL} && ") != 1:
        raise SystemExit(f"--wheel replaces the install target of README's first command, which should contain "
                         f"{PLAIN_INSTALL + ' && '!r} once; got {found!r}")
    return found.replace(f" {PLAIN_INSTALL} && ", f" {PLAIN_INSTALL[:-1]}{shlex.quote(str(wheel))} && ")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--wheel"):
        raise SystemExit("usage: python3 .ci/readme_command.py (example [--wheel WHEEL] | tests)")
    print(command(args[0], wheel=args[2] if len(args) == 3 else None))
