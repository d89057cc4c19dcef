"""Hang forensics' py-spy fallback (raysgd.torch.execution.diagnostics), cluster-free."""
import os

import pytest

from raysgd.torch.execution import diagnostics


@pytest.mark.parametrize("mode", [0o644, 0o755], ids=["not executable", "not a program"])
def test_py_spy_that_cannot_run_is_a_sentence_not_an_error(tmp_path, monkeypatch, mode):
    """A py-spy that the OS refuses to run (no execute bit, another machine's build) says so as the rank's "stack":
    an OSError escaping would replace every rank's stacks in the WorkerFailure with that one error."""
    binary = tmp_path / "py-spy"
    binary.write_text("not a program")
    binary.chmod(mode)
    monkeypatch.setattr(diagnostics, "py_spy_path", lambda: str(binary))
    text = diagnostics.py_spy_dump(os.getpid())
    assert text.startswith("no stack: ") and str(binary) in text and "could not be run" in text
