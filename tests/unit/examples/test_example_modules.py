"""The 1.x example modules in-process (no Ray): CIFAR-10 file loading, synthetic data, the DCGAN operator."""
import pickle

import numpy as np
import pytest
import torch

from raysgd.torch.examples import cifar_pytorch_example as cifar
from raysgd.torch.execution.worker import TorchWorker
from raysgd.utils import BATCH_SIZE


def _write_fake_cifar(folder, per_batch=6):
    """Files in the layout and pickle format of the CIFAR-10 python version (tiny, with known pixels)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, size=per_batch)]
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, handle)
    return folder


def test_real_cifar_files_load_from_the_folder_or_its_parent(tmp_path):
    folder = _write_fake_cifar(tmp_path / "cifar-10-batches-py")
    for data_dir in (folder, tmp_path):
        train, val = cifar.load_cifar10(str(data_dir))
        assert (len(train), len(val)) == (30, 6)
    with open(folder / "test_batch", "rb") as handle:
        raw = pickle.load(handle)
    image, label = val[2]
    expected = torch.tensor(raw[b"data"][2].reshape(3, 32, 32) / 255.0, dtype=torch.float32)
    mean, std = torch.tensor(cifar.CIFAR_MEAN).view(3, 1, 1), torch.tensor(cifar.CIFAR_STD).view(3, 1, 1)
    assert torch.allclose(image, (expected - mean) / std, atol=1e-5) and label.item() == raw[b"labels"][2]
    assert train[0][0].shape == (3, 32, 32)  # augmented: padded random crop keeps the size


def test_missing_cifar_files_say_where_they_were_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1 .* found none"):
        cifar.load_cifar10(str(tmp_path))


def test_synthetic_cifar_is_deterministic_and_class_structured():
    a_images, a_labels = cifar.synthetic_cifar(200, seed=3)
    b_images, _ = cifar.synthetic_cifar(200, seed=3)
    assert np.array_equal(a_images, b_images)
    means = np.stack([a_images[a_labels == c].mean(axis=0) for c in range(10)])
    spread_between = means.std(axis=0).mean()
    spread_within = a_images[a_labels == 0].std(axis=0).mean()
    assert spread_between > 0.5 * spread_within  # classes differ, so there is something to learn


def test_dcgan_operator_trains_both_models_under_bf16(tmp_path):
    from raysgd.torch.examples import dcgan

    path = dcgan.train_classifier(str(tmp_path / "classifier.pt"), epochs=30)
    worker = TorchWorker(dcgan.GANOperator, {BATCH_SIZE: 16, "limit": 64, "classification_model_path": path},
                         use_fp16="bf16", is_local=True)
    worker.setup_operator()
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in worker.operator.registered_models()]
    stats = worker.train_epoch(num_steps=3)
    assert stats["batch_count"] == 3 and stats["num_samples"] == 48
    assert {"loss_d", "loss_g", "inception"} <= set(stats) and 1.0 <= stats["inception"] <= 10.0
    for old, model in zip(before, worker.operator.registered_models()):  # discriminator and generator
        assert any(not torch.equal(old[k], v) for k, v in model.state_dict().items())
    assert worker.operator.sample(4).shape == (4, 1, 8, 8)


def test_inception_score_bounds():
    from raysgd.torch.examples.dcgan import inception_score

    confident = torch.nn.Linear(10, 10)
    with torch.no_grad():
        confident.weight.copy_(torch.eye(10) * 50)
        confident.bias.zero_()
    assert inception_score(confident, torch.eye(10)) == pytest.approx(10.0, rel=1e-3)  # 10 crisp classes
    assert inception_score(confident, torch.eye(10)[[3] * 10]) == pytest.approx(1.0, abs=1e-3)  # one class


# ------------------------------------------------------- the example creators read their config as RaySGD 1.12 did
def _local_worker(operator_cls, config, scheduler_step_freq=None):
    worker = TorchWorker(operator_cls, config, is_local=True, scheduler_step_freq=scheduler_step_freq)
    worker.setup_operator()
    return worker


def test_tune_example_trains_with_batch_size_from_batch_size_key_like_1_12():
    from raysgd.torch.examples import tune_example

    # 1.12's tune_example read config[BATCH_SIZE] (the worker's share): 1,000 points in batches of 128 is 8 batches
    worker = _local_worker(tune_example.get_custom_training_operator(lr_reduce_on_plateau=True), {BATCH_SIZE: 128},
                           scheduler_step_freq="manual")
    assert worker.train_epoch()["batch_count"] == 8  # batches of 32 (train_example's default) would be 32
    assert worker.operator.optimizer.defaults["lr"] == 1e-4  # 1.12's default when Tune gives no lr
    assert worker.operator.scheduler.patience == 10  # ReduceLROnPlateau(mode="min") with torch's patience
    with pytest.raises(KeyError, match=r"reads config\[BATCH_SIZE\].*has \['batch_size'\]"):
        tune_example.data_creator({"batch_size": 64})


def test_train_example_reads_batch_size_and_else_the_share_of_batch_size():
    from raysgd.torch.examples import train_example

    assert train_example.data_creator({"batch_size": 4})[0].batch_size == 4  # 1.12's key, 1.12's result
    assert train_example.data_creator({})[0].batch_size == 32
    assert train_example.data_creator({BATCH_SIZE: 64})[0].batch_size == 64  # 1.12 ignored it: 32
    assert train_example.data_creator({"batch_size": 4, BATCH_SIZE: 64})[0].batch_size == 4


@pytest.mark.parametrize("size", [np.int64(8), np.float32(8.0), 8.0])
def test_train_example_takes_a_numpy_or_whole_float_batch_size(size):
    """A Tune sample (numpy) or 8.0: DataLoader refused it ("batch_size should be a positive integer value")."""
    from raysgd.torch.examples import train_example

    loader = train_example.data_creator({"batch_size": size, "data_size": 16})[0]
    assert loader.batch_size == 8 and type(loader.batch_size) is int


def test_dcgan_operator_takes_1_12s_config(tmp_path):
    from raysgd.torch.examples import dcgan

    path = dcgan.train_classifier(str(tmp_path / "classifier.pt"), epochs=5)
    # 1.12's dcgan.train_example(test_mode=True) config: "batch_size" 16 and "test_mode" (64 images)
    worker = _local_worker(dcgan.GANOperator, {"test_mode": True, "batch_size": 16, "latent_vector_size": 8,
                                               "classification_model_path": path})
    stats = worker.train_epoch()
    assert stats["batch_count"] == 4 and stats["num_samples"] == 64
    assert worker.operator.sample(2).shape == (2, 1, 8, 8) and worker.operator.latent_dim == 8


def test_cifar_operator_reads_momentum_like_1_12():
    worker = _local_worker(cifar.CifarTrainingOperator, {"test_mode": True, "momentum": 0.5, BATCH_SIZE: 32},
                           scheduler_step_freq="epoch")
    assert worker.operator.optimizer.defaults["momentum"] == 0.5
