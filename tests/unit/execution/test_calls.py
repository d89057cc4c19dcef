"""How a worker's failed call is told to the user (raysgd.torch.execution.calls), cluster-free: Ray's exceptions are
built locally."""
from ray.exceptions import RayActorError

from raysgd.torch.errors import CollectiveError, WorkerFailure
from raysgd.torch.execution import calls


def test_a_message_starting_with_a_line_break_is_still_told():
    """NCCL's and some libraries' messages start with a line break: the one-line cause must not be empty."""
    error = RuntimeError("\n  \nNCCL error: remote process exited or there was a network error\nLast error: ...")
    assert calls.describe(error) == "RuntimeError: NCCL error: remote process exited or there was a network error"
    failure = WorkerFailure("worker failure", {1: calls.describe(error)})
    assert "rank 1: RuntimeError: NCCL error: remote process exited" in failure.summary()
    assert WorkerFailure("worker failure", {1: error}).summary().startswith("rank 1: NCCL error: remote process")


def test_describe_keeps_its_one_line_forms():
    assert calls.describe(ValueError("")) == "ValueError: "
    assert calls.describe(ValueError("bad\nsecond")) == "ValueError: bad"
    assert calls.describe(CollectiveError(2, "gloo timed out")) == "gloo timed out"
    assert calls.describe(RayActorError()).startswith("worker process died (The actor")
