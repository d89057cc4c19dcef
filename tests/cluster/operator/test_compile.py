"""torch.compile'd models: trained as compile(DDP(model)), saved and returned as the plain module.

The ``"eager"`` backend runs dynamo's capture and the compiled-module wrappers without a C++ compiler (the
CPU's inductor backend needs one), and computes with the same kernels as the plain model, so the results
can be compared exactly. On the GPU, ``tests/cluster/execution/test_cuda.py`` compiles with the default backend.
"""
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from helpers import LinearOperator
from raysgd.torch.operator import compiled

pytestmark = pytest.mark.usefixtures("ray_2cpus")


#: What users write: register(models=torch.compile(model, backend="eager")); momentum gives optimizer state.
COMPILED = {"compile": {"backend": "eager"}, "momentum": 0.9}
PLAIN = {"momentum": 0.9}


def kinds(op):
    """What trains (outer wrapper, and what it wraps) and what is saved."""
    inner = compiled.compiled_inner(op.model)
    return (type(op.model).__name__, type(inner).__name__ if inner is not None else None,
            type(op.registered_models()[0]).__name__)


def _trained(trainer_factory, num_workers, compile_it):
    """A trainer of the plain or the compiled model after 2 epochs: ``(trainer, (losses, state, kinds))``."""
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=num_workers,
                              config={**(COMPILED if compile_it else PLAIN), "data_size": 64})
    losses = [trainer.train()["train_loss"] for _ in range(2)]
    return trainer, (losses, trainer.state_dict(), trainer.apply_all_operators(kinds)[0])


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_compiled_model_trains_exactly_like_the_plain_one_and_saves_plain_keys(trainer_factory, tmp_path,
                                                                                  num_workers):
    """On 1 worker the same two trainers then move checkpoints between the compiled and the plain model (one
    trainer start per model instead of two: each is seconds of worker start-up)."""
    plain, plain_result = _trained(trainer_factory, num_workers, False)
    if num_workers == 2:
        plain.shutdown()  # two CPUs: one 2-worker trainer at a time
    compiled_trainer, compiled_result = _trained(trainer_factory, num_workers, True)
    (plain_losses, plain_state, _), (losses, state_, trained) = plain_result, compiled_result
    if num_workers == 2:  # compiled outside DDP, as PyTorch advises: compile(DDP(plain))
        assert trained == ("OptimizedModule", "DistributedDataParallel", "Linear")
    else:
        assert trained == ("OptimizedModule", "Linear", "Linear")
    assert list(state_["models"][0]) == ["weight", "bias"]  # no "_orig_mod." prefix
    assert losses == plain_losses
    for key, value in plain_state["models"][0].items():
        assert torch.equal(state_["models"][0][key], value), key
    assert torch.equal(state_["optimizers"][0]["state"][0]["momentum_buffer"],
                       plain_state["optimizers"][0]["state"][0]["momentum_buffer"])
    if num_workers == 1:
        _checkpoints_move_between_compiled_and_plain_models(compiled_trainer, plain, tmp_path)


def _checkpoints_move_between_compiled_and_plain_models(source, plain, tmp_path):
    source.save(str(tmp_path / "compiled.ckpt"))
    assert type(source.get_model()) is nn.Linear and type(source.get_model(to_cpu=True)) is nn.Linear
    expected = source.state_dict()["models"][0]
    plain.load(str(tmp_path / "compiled.ckpt"))
    assert all(torch.equal(plain.state_dict()["models"][0][k], v) for k, v in expected.items())
    plain.shutdown()
    # a checkpoint whose model keys carry the prefix (torch.save of a compiled model's state_dict) loads too
    old = torch.load(str(tmp_path / "compiled.ckpt"), weights_only=True)
    old["models"] = [{"_orig_mod." + k: v + 1 for k, v in old["models"][0].items()}]
    torch.save(old, str(tmp_path / "prefixed.ckpt"))
    source.load(str(tmp_path / "prefixed.ckpt"))
    assert all(torch.equal(source.state_dict()["models"][0][k], v + 1) for k, v in expected.items())
    assert source.train()["num_samples"] == 64  # the compiled model trains on the loaded weights


def test_a_mismatched_checkpoint_still_fails_loudly():
    model = nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match="Missing key"):
        compiled.load_model_state(model, {"_orig_mod.other.weight": torch.ones(1, 1)})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        compiled.load_model_state(model, {"weight": torch.ones(1, 1), "bias": torch.ones(1), "extra": torch.ones(1)})


def test_unwrapping_goes_through_compile_and_ddp_in_any_order(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a default process group (a use_local trainer is alive)")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        plain = nn.Linear(1, 1)
        ddp = DistributedDataParallel(plain)
        outer = torch.compile(ddp, backend="eager")
        inner = DistributedDataParallel(torch.compile(plain, backend="eager"))
        for wrapped in (ddp, outer, inner):
            assert compiled.original(wrapped) is plain
        assert compiled.find_ddp(outer) is ddp and compiled.find_ddp(inner) is inner
        assert compiled.find_ddp(plain) is None and compiled.find_ddp(torch.compile(plain, backend="eager")) is None
        rewrapped = compiled.wrap_ddp(torch.compile(plain, backend="eager"), DistributedDataParallel)
        assert compiled.find_ddp(rewrapped).module is plain and compiled.compiled_inner(rewrapped) is not None
    finally:
        dist.destroy_process_group()
