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


def test_a_user_error_keeps_its_type_and_cause_and_its_traceback_names_the_rank():
    """The driver re-raises the worker's own exception: its type and message stay, the worker's traceback is its
    cause, and the traceback says which rank raised it (pid and ip alone do not say it)."""
    import traceback

    from ray.exceptions import RayTaskError

    try:
        raise ValueError("bad batch")
    except ValueError as err:
        original = err
    remote = RayTaskError("train_epoch", "".join(traceback.format_exception(original)), original).as_instanceof_cause()
    outcome = calls.collect({0: calls.Done(lambda: 1), 1: calls.Done(lambda: (_ for _ in ()).throw(remote))},
                            timeout_s=10)
    assert outcome.kind == calls.USER_ERROR and type(outcome.error) is ValueError and str(outcome.error) == "bad batch"
    assert isinstance(outcome.error.__cause__, RayTaskError)
    text = "".join(traceback.format_exception(outcome.error))
    assert "raised by the worker of rank 1" in text and text.count("raised by the worker of rank") == 1
