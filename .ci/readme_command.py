"""Print one of README.md's two set-up commands, so that .ci/run runs exactly what README says.

    python3 .ci/readme_command.py example   # the first: plain install, then examples/train_linear.py
    python3 .ci/readme_command.py tests     # the second: install with the test extra, then pytest

Standard library only (it runs before any virtual environment exists). tests/test_repository.py
checks that it finds README's commands and that .ci/run runs them.
"""
import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def setup_commands(text):
    """The ```bash blocks of ``text`` that set up a virtual environment, in order."""
    blocks = re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)
    return [block for block in blocks if block.startswith("python3 -m venv")]


def command(kind, text=None):
    """README's ``example`` or ``tests`` set-up command; SystemExit naming what is wrong when it is not there."""
    commands = setup_commands(README.read_text() if text is None else text)
    if len(commands) != 2:
        raise SystemExit(f"README.md should hold 2 set-up commands (```bash blocks starting 'python3 -m venv'); "
                         f"found {len(commands)}")
    wanted = {"example": 0, "tests": 1}
    if kind not in wanted:
        raise SystemExit(f"expected 'example' or 'tests'; got {kind!r}")
    return commands[wanted[kind]]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 .ci/readme_command.py (example | tests)")
    print(command(sys.argv[1]))
