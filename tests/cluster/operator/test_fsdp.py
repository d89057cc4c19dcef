"""TorchTrainer(strategy="fsdp"): FSDP2's fully_shard on real gloo groups of Ray actors, against one process.

Every parity test trains a sharded model on 2 or 3 workers and the same model in this process on the same global
batches: the loaders are sequential, so worker ``r`` of ``W`` reads positions ``r, r + W, ...`` and one step of all
workers together reads the next ``BATCH_SIZE`` samples in order. The models' parameter sizes (7 and 3 rows, 5
columns) do not divide by 3 (nor 7 by 2): the shards are uneven.
"""
import copy
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import assert_released
from helpers import BatchNormOperator, buffers_of
from raysgd import TorchTrainer, TrainingOperator
from raysgd.torch.execution.worker import TorchWorker
from raysgd.torch.operator import fsdp
from raysgd.torch.options import TrainerOptions
from raysgd.utils import BATCH_SIZE

try:
    fsdp.check_strategy("fsdp")
except ValueError as err:
    pytest.skip(f"this torch cannot run FSDP2 on CPU: {err}", allow_module_level=True)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_4cpus")

N, GLOBAL, LR = 48, 12, 0.01


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def data(n=N):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=generator), torch.randn(n, 3, generator=generator)


class MLPOperator(TrainingOperator):
    """The default loops on :func:`mlp` with Adam (SGD with ``config["sgd"]``); ``config["compile"]``: registered as
    ``torch.compile(model, **config["compile"])``; 11 validation samples in batches of ``config["val_batch"]``."""

    def setup(self, config):
        x, y = data(config.get("n", N))
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if config.get("sgd") else \
            torch.optim.Adam(model.parameters(), lr=LR)
        if config.get("compile") is not None:
            model = torch.compile(model, **config["compile"])
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.MSELoss())
        val = config.get("val_n", 11)
        self.register_data(train_loader=DataLoader(TensorDataset(x, y), batch_size=config[BATCH_SIZE]),
                           validation_loader=DataLoader(TensorDataset(x[:val], y[:val]),
                                                        batch_size=config.get("val_batch", 5)))


def reference(steps, global_batch=GLOBAL, sgd=False, epochs=1, n=N):
    """:func:`mlp` trained in this process on ``steps`` global batches of each epoch, in order (a partial last)."""
    model, (x, y) = mlp(), data(n)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.Adam(model.parameters(), lr=LR)
    for _ in range(epochs):
        for start in list(range(0, n, global_batch))[:steps]:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[start:start + global_batch]), y[start:start + global_batch]).backward()
            optimizer.step()
    return model


def validation_loss(model, n=11):
    x, y = data()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x[:n]), y[:n]).item()


def assert_same_parameters(got, want, rtol=1e-5, atol=1e-7):
    assert type(got) is type(want) and not isinstance(got, FSDPModule)
    for (name, mine), (_, theirs) in zip(got.state_dict().items(), want.state_dict().items()):
        assert mine.device.type == "cpu" and type(mine) is torch.Tensor, name
        assert torch.allclose(mine, theirs, rtol=rtol, atol=atol), (name, mine, theirs)


def assert_sharded(trainer, num_workers, model=mlp):
    """Every rank holds a part of each parameter (its own shard), and the parts add up to the whole."""
    sizes = trainer.apply_all_operators(lambda op: (op.strategy, [p.to_local().numel()
                                                                  for p in op.registered_models()[0].parameters()]))
    whole = [p.numel() for p in model().parameters()]
    assert [strategy for strategy, _ in sizes] == ["fsdp"] * num_workers
    assert [sum(column) for column in zip(*(counts for _, counts in sizes))] == whole
    assert all(counts != whole for _, counts in sizes)


def test_two_sharded_workers_match_one_process_validate_uneven_shards_and_save_and_load_the_whole(trainer_factory,
                                                                                                 tmp_path):
    """Validation: 11 samples in batches of 5 are 2 batches on rank 0 and 1 on rank 1 (no collective per batch).
    The state: ``state_dict()`` and ``save()`` consolidate the shards into whole tensors on the driver, and
    ``load_state_dict()``/``load()`` put each rank's shard of them back."""
    trainer = trainer_factory(training_operator_cls=MLPOperator, num_workers=2, strategy="fsdp",
                              config={BATCH_SIZE: GLOBAL})
    assert_sharded(trainer, 2)
    assert trainer.train(num_steps=2)["num_samples"] == 2 * GLOBAL
    assert_same_parameters(trainer.get_model(), reference(steps=2))
    assert trainer.validate()["val_loss"] == pytest.approx(validation_loss(reference(steps=2)), rel=1e-5)
    assert trainer.train(num_steps=1)["num_samples"] == GLOBAL  # training goes on after validation
    assert_same_parameters(trainer.get_model(), reference(steps=3))
    # the whole state, consolidated on the driver where it is asked for, loads back into the shards; save() writes
    # a DCP folder of the parts (or, consolidated, one file), and load() reads either
    saved, folder, whole = trainer.state_dict(), str(tmp_path / "parts"), str(tmp_path / "whole.ckpt")
    want = reference(steps=3).state_dict()
    assert set(saved["models"][0]) == set(want) and all(
        torch.allclose(saved["models"][0][key], want[key], rtol=1e-5, atol=1e-7) for key in want)
    assert trainer.save(folder) == folder and trainer.save(whole, consolidated=True) == whole
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "checkpoint.json"} <= set(os.listdir(folder))
    assert os.path.isfile(whole)
    for load in (lambda: trainer.load_state_dict(saved, blocking=True), lambda: trainer.load(folder, blocking=True),
                 lambda: trainer.load(whole, blocking=True)):
        trainer.train(num_steps=1)
        load()
        assert_same_parameters(trainer.get_model(), reference(steps=3))
    assert trainer.controller.commits.enabled  # commits hold every rank's part (tests/cluster/state/test_fsdp_state.py)


def test_batch_norm_buffers_follow_ddp_rank_0_broadcast_at_each_forward(trainer_factory):
    """FSDP2 does not synchronise buffers; raysgd keeps DDP's semantics (rank 0's, broadcast at the forward after
    one with gradients): the same BatchNorm ResNet trained with strategy="ddp" and "fsdp" on the same batches ends
    with the same parameters and running statistics, on every rank."""
    results = {}
    for strategy in ("ddp", "fsdp"):
        trainer = trainer_factory(training_operator_cls=BatchNormOperator, num_workers=2, strategy=strategy,
                                  config={"n": 40, "batch_size": 4})
        trainer.train()
        results[strategy] = (trainer.get_model().state_dict(), trainer.validate()["val_loss"],
                             trainer.apply_all_operators(lambda op: buffers_of(op.registered_models()[0])))
        trainer.shutdown()
    (ddp, ddp_loss, _), (sharded, sharded_loss, per_rank) = results["ddp"], results["fsdp"]
    assert set(ddp) == set(sharded) and ddp["1.num_batches_tracked"].item() == 5
    for name in ddp:
        assert torch.allclose(ddp[name], sharded[name], rtol=1e-4, atol=1e-6), name
    assert sharded_loss == pytest.approx(ddp_loss, rel=1e-4)
    assert all(torch.equal(rank[name], per_rank[0][name]) for rank in per_rank for name in rank)


class ShardProbeOperator(MLPOperator):
    """Records, after each validation forward, whether the first block's weight is still this rank's shard (a
    DTensor: FSDP resharded it) and which batches were padding."""

    def setup(self, config):
        super().setup(config)
        self.sharded_after_forward, self.padding = [], []

    def validate_batch(self, batch, batch_info):
        result = super().validate_batch(batch, batch_info)
        self.sharded_after_forward.append(isinstance(self.model[0].weight, DTensor))
        self.padding.append(bool(batch_info.get("padding")))
        return result


@pytest.mark.parametrize("val_n, mode", [(11, None), (1, None), (11, "gathered")])
def test_validation_stays_sharded_in_lockstep_and_its_metrics_are_exact(trainer_factory, val_n, mode):
    """By default no rank gathers the whole model to validate: 11 samples in batches of 5 are 2 batches on rank 0
    and 1 on rank 1, which pads once (its last batch again, the result dropped); with 1 sample rank 1 has none and
    pads with rank 0's batch. The loss is the one process's either way; fsdp_args={"validation": "gathered"} keeps
    each model whole on every rank while it validates (no padding needed)."""
    trainer = trainer_factory(training_operator_cls=ShardProbeOperator, num_workers=2, strategy="fsdp",
                              fsdp_args={"validation": mode} if mode else None,
                              config={BATCH_SIZE: GLOBAL, "val_n": val_n})
    trainer.train(num_steps=2)
    assert trainer.validate()["val_loss"] == pytest.approx(validation_loss(reference(steps=2), val_n), rel=1e-5)
    probes = trainer.apply_all_operators(lambda op: (op.sharded_after_forward, op.padding))
    if mode == "gathered":
        assert probes == [([False, False], [False, False]), ([False], [False])]
    elif val_n == 11:
        assert probes == [([True, True], [False, False]), ([True, True], [False, True])]
    else:
        assert probes == [([True], [False]), ([True], [True])]
    trainer.train(num_steps=1)  # training goes on after it
    assert_same_parameters(trainer.get_model(), reference(steps=3))


def test_three_workers_with_a_compiled_model_and_rank_0_here_match_one_process(trainer_factory):
    """Uneven shards on 3 (7 rows: 3, 3, 1); torch.compile (the eager backend: Dynamo without a C++ compiler)
    compiles the sharded module; use_local puts rank 0 and its FSDP state in this process."""
    trainer = trainer_factory(training_operator_cls=MLPOperator, num_workers=3, strategy="fsdp", use_local=True,
                              config={BATCH_SIZE: GLOBAL, "compile": {"backend": "eager"}, "val_batch": 3})
    assert_sharded(trainer, 3)
    local = trainer.get_local_operator()
    assert type(local.model).__name__ == "OptimizedModule" and isinstance(local.registered_models()[0], FSDPModule)
    trainer.train(num_steps=3)
    assert_same_parameters(trainer.get_model(), reference(steps=3))
    assert trainer.validate()["val_loss"] == pytest.approx(validation_loss(reference(steps=3)), rel=1e-5)


class GANOperator(TrainingOperator):
    """Two models and two optimizers stepped one after the other in a custom ``train_batch`` (a GAN's shape), through
    an enabled CPU GradScaler (``Precision`` enables one on CUDA only; scaling by 2**8 is exact in fp32). With
    ``self.inf_at`` set, rank 1 puts an inf into its discriminator gradient shard at that step."""

    def setup(self, config):
        torch.manual_seed(0)
        generator, discriminator = nn.Linear(3, 5), nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
        opt_g = torch.optim.Adam(generator.parameters(), lr=LR)
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=LR)
        self.models, self.optimizers = self.register(models=[generator, discriminator], optimizers=[opt_g, opt_d])
        self.register_data(train_loader=DataLoader(TensorDataset(*gan_data()), batch_size=config[BATCH_SIZE]))
        self.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        self.inf_at = None

    def train_batch(self, batch, batch_info):
        def step(loss, optimizer, update_scale=True):
            optimizer.zero_grad()
            self.backward(loss, optimizer)
            if self.world_rank == 1 and optimizer is self.optimizers[1] and self.inf_at == batch_info["global_step"]:
                next(self.models[1].parameters()).grad.to_local().view(-1)[0] = float("inf")
            self.step(optimizer, update=update_scale)

        return gan_step(*self.models, *self.optimizers, *batch, step=step)


def gan_data():
    generator = torch.Generator().manual_seed(2)
    return torch.randn(N, 5, generator=generator), torch.randn(N, 3, generator=generator)


def gan_step(generator, discriminator, opt_g, opt_d, real, noise, step):
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = generator(noise)
    real_score, fake_score = discriminator(real), discriminator(fake.detach())
    d_loss = bce(real_score, torch.ones_like(real_score)) + bce(fake_score, torch.zeros_like(fake_score))
    step(d_loss, opt_d, update_scale=False)
    score = discriminator(fake)
    g_loss = bce(score, torch.ones_like(score))
    step(g_loss, opt_g)
    return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach(), "num_samples": len(real)}


def test_two_models_in_a_custom_train_batch_match_one_process_and_skip_overflows_together(trainer_factory):
    """The skip shows why use_fp16=True keeps its meaning under FSDP: GradScaler's inf check on DTensor gradients is
    agreed by the ranks, so an inf in one rank's shard skips the step everywhere."""
    trainer = trainer_factory(training_operator_cls=GANOperator, num_workers=2, strategy="fsdp",
                              config={BATCH_SIZE: GLOBAL})
    assert_sharded(trainer, 2, model=lambda: nn.Linear(3, 5))
    assert trainer.train(num_steps=3)["num_samples"] == 3 * GLOBAL
    torch.manual_seed(0)
    generator, discriminator = nn.Linear(3, 5), nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=LR) for m in (generator, discriminator))

    def step(loss, optimizer, update_scale=True):
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    real, noise = gan_data()
    for start in range(0, 3 * GLOBAL, GLOBAL):
        gan_step(generator, discriminator, opt_g, opt_d, real[start:start + GLOBAL], noise[start:start + GLOBAL], step)
    got_generator, got_discriminator = trainer.get_model()
    assert_same_parameters(got_generator, generator)
    assert_same_parameters(got_discriminator, discriminator)

    def discriminator_shards(op):
        return [p.to_local().clone() for p in op.models[1].parameters()], op.precision.scaler.get_scale()

    before = trainer.apply_all_operators(discriminator_shards)
    trainer.apply_all_operators(lambda op: setattr(op, "inf_at", op.global_step))
    trainer.train(num_steps=1)
    for (old, old_scale), (new, new_scale) in zip(before, trainer.apply_all_operators(discriminator_shards)):
        assert all(torch.equal(a, b) for a, b in zip(old, new)) and new_scale == old_scale / 2


def test_accumulated_micro_batches_make_the_global_batch_and_the_partial_step(trainer_factory):
    """fixed_worker_batch on (1, 4) with 2 CPUs each: 2 workers fit on 4 CPUs, each accumulates 2 micro-batches of
    3 per step of 12; 42 samples end each epoch on a partial step of one micro-batch (6 samples), which the flush
    steps. SGD shows any scaling error."""
    trainer = trainer_factory(training_operator_cls=MLPOperator, num_workers=(1, 4), num_cpus_per_worker=2,
                              strategy="fsdp", fixed_worker_batch=True, config={BATCH_SIZE: GLOBAL, "sgd": True,
                                                                               "n": 42})
    assert trainer.apply_all_operators(lambda op: (op.strategy, op.accumulation_steps)) == [("fsdp", 2)] * 2
    for _ in range(2):
        assert trainer.train()["num_samples"] == 42
    assert trainer.apply_all_operators(lambda op: op.global_step) == [8, 8]  # 3 full steps and 1 partial, twice
    assert_same_parameters(trainer.get_model(), reference(steps=4, sgd=True, epochs=2, n=42))


def test_bf16_computes_in_bfloat16_and_keeps_float32_shards(trainer_factory):
    trainer = trainer_factory(training_operator_cls=MLPOperator, num_workers=2, strategy="fsdp", use_fp16="bf16",
                              config={BATCH_SIZE: GLOBAL})

    def dtypes(op):
        with torch.no_grad():
            out = op.model(torch.randn(2, 5))  # outside autocast: the policy's bfloat16 parameters compute
        return out.dtype, {p.dtype for p in op.model.parameters()}, op.precision.autocast_dtype

    assert trainer.apply_all_operators(dtypes) == [(torch.bfloat16, {torch.float32}, torch.bfloat16)] * 2
    first = trainer.train(num_steps=2)["train_loss"]
    assert trainer.train(num_steps=2)["train_loss"] < first
    assert_same_parameters(trainer.get_model(), reference(steps=4), rtol=0.05, atol=0.01)  # bfloat16's precision


def test_one_worker_trains_unsharded_and_its_state_loads(tmp_path):
    """Nothing to shard over: the model stays plain (strategy "ddp"), so the state works as for DDP; the options
    keep commits and storage_path. In this process (a local worker, no Ray)."""
    options = TrainerOptions(training_operator_cls=MLPOperator, strategy="fsdp", storage_path=str(tmp_path)).checked()
    assert options.commit_every_n_steps is None and options.storage_path == str(tmp_path)
    worker = TorchWorker(MLPOperator, {BATCH_SIZE: GLOBAL}, is_local=True, strategy="fsdp")
    worker.setup_operator()
    assert worker.operator.strategy == "ddp" and type(worker.operator.model) is nn.Sequential
    state = copy.deepcopy(worker.state_dict())  # (its tensors are the model's own)
    worker.train_epoch(num_steps=2)
    assert_same_parameters(worker.full_models()[0], reference(steps=2))
    worker.load_state_dict(state)
    assert_same_parameters(worker.full_models()[0], mlp())


def test_an_optimizer_with_state_and_ddp_args_are_refused_before_sharding():
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model(torch.ones(1, 5)).sum().backward()
    optimizer.step()  # state for whole parameters: it cannot follow them into shards
    with pytest.raises(ValueError, match=r"TrainingOperator: register\(optimizers=\.\.\.\) expects optimizers without "
                                         r"state under strategy='fsdp'.*got 'Adam holding state for 4 parameters'"):
        fsdp.Sharding("fsdp", world_size=2).shard([model], [optimizer])
    with pytest.raises(ValueError, match=r"register\(ddp_args=\.\.\.\) expects None under strategy='fsdp'"):
        fsdp.Sharding("fsdp", world_size=2).shard([model], [], {"find_unused_parameters": True})


@pytest.mark.parametrize("kwargs, error, words", [
    ({"strategy": "zero3"}, ValueError, "strategy expects 'ddp' or 'fsdp'; got 'zero3'"),
    ({"strategy": "fsdp", "use_fp16": "apex"}, ValueError, "use_fp16 expects False, True or 'bf16' with "
                                                           "strategy='fsdp'"),
    ({"strategy": "fsdp", "wrap_ddp": False}, ValueError, "wrap_ddp expects True (its default)"),
    ({"fsdp_args": {"reshard_after_forward": False}}, ValueError, "fsdp_args expects None with strategy='ddp'"),
    ({"strategy": "fsdp", "fsdp_args": [1]}, TypeError, "fsdp_args expects a dict or None; got [1]"),
    ({"strategy": "fsdp", "fsdp_args": {"mesh": None}}, ValueError, "fsdp_args expects keys among"),
    ({"strategy": "fsdp", "fsdp_args": {"reshard_after_forward": 2}}, TypeError,
     "fsdp_args['reshard_after_forward'] expects True, False or None; got 2"),
    ({"strategy": "fsdp", "fsdp_args": {"mp_policy": "bf16"}}, TypeError,
     "fsdp_args['mp_policy'] expects a torch.distributed.fsdp.MixedPrecisionPolicy; got 'bf16'"),
    ({"strategy": "fsdp", "use_fp16": "bf16", "fsdp_args": {"mp_policy": MixedPrecisionPolicy()}}, ValueError,
     "use_fp16 expects False with fsdp_args['mp_policy']"),
    ({"strategy": "fsdp", "fsdp_args": {"offload_policy": "cpu"}}, TypeError, "offload_policy'] expects a"),
    ({"strategy": "fsdp", "fsdp_args": {"shard_policy": 3}}, TypeError, "fsdp_args['shard_policy'] expects a"),
])
def test_bad_strategy_values_are_refused_before_any_actor_starts(kwargs, error, words, monkeypatch):
    import raysgd.torch.torch_trainer as torch_trainer

    def no_workers(*args, **kw):
        raise AssertionError("a worker group was built")

    monkeypatch.setattr(torch_trainer, "WorkerGroup", no_workers)
    with pytest.raises(error) as raised:
        TorchTrainer(training_operator_cls=MLPOperator, num_workers=2, config={BATCH_SIZE: GLOBAL}, **kwargs)
    assert str(raised.value).startswith("TorchTrainer: ") and words in str(raised.value), raised.value
    assert_released()


def test_an_old_torch_and_a_cpu_offload_on_cpu_are_refused_naming_what_is_needed():
    with pytest.raises(ValueError, match=r"strategy='fsdp' expects torch >= 2.9 .*got torch 2.8.0"):
        fsdp.check_strategy("fsdp", torch_version="2.8.0")  # its gloo path reduces gradients to twice their mean
    assert fsdp.check_strategy("fsdp", torch_version="2.9.0") == "fsdp"
    with pytest.raises(ValueError, match="no CPUOffloadPolicy when the workers train on CPU"):
        fsdp.check_fsdp_args({"offload_policy": CPUOffloadPolicy()}, "fsdp", use_gpu=False)
    assert fsdp.check_fsdp_args({"offload_policy": CPUOffloadPolicy()}, "fsdp", use_gpu=True)


def test_the_default_and_a_users_shard_policy_pick_blocks_deepest_first():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(2, 2), nn.Tanh())

        def forward(self, x):
            return self.inner(x)

    model = nn.Sequential(Block(), nn.ReLU(), nn.ModuleList([nn.Linear(2, 2)]), nn.Linear(2, 1))
    assert [name for name, _ in fsdp.blocks(model, None)] == ["3", "2.0", "0.inner.0", "0"]
    assert [name for name, _ in fsdp.blocks(model, Block)] == ["0"]
    assert [name for name, _ in fsdp.blocks(model, lambda m: isinstance(m, nn.Linear))] == ["3", "2.0", "0.inner.0"]
