"""raysgd.torch.resnet: the CIFAR ResNets of RaySGD 1.x (shapes, sizes, 1.x parameter names, argument errors)."""
import pytest
import torch

from raysgd.torch import resnet


@pytest.mark.parametrize("name, params", [("ResNet18", 11_173_962), ("ResNet34", 21_282_122),
                                          ("ResNet50", 23_520_842)])
def test_sizes_and_output_shape(name, params):
    model = getattr(resnet, name)({"num_classes": 10})
    assert sum(p.numel() for p in model.parameters()) == params
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_constructors_take_the_config_like_1x():
    assert resnet.ResNet18(None).linear.out_features == 10
    assert resnet.ResNet18({"lr": 0.1}).linear.out_features == 10
    assert resnet.ResNet18({"num_classes": 100}).linear.out_features == 100
    with pytest.raises(TypeError, match="trainer config"):
        resnet.ResNet18(3)


def test_parameter_names_match_1x_checkpoints():
    keys = set(resnet.ResNet18().state_dict())
    for key in ("conv1.weight", "bn1.running_mean", "layer1.0.conv1.weight", "layer1.0.bn2.bias",
                "layer2.0.shortcut.0.weight", "layer2.0.shortcut.1.running_var", "layer4.1.conv2.weight",
                "linear.weight", "linear.bias"):
        assert key in keys
    assert not any(k.startswith("layer1.0.shortcut") for k in keys)  # identity shortcut: no parameters
    assert "layer3.0.conv3.weight" in resnet.ResNet50().state_dict()


def test_trains_on_a_tiny_batch():
    torch.manual_seed(0)
    model = resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=2)
    x, y = torch.randn(8, 3, 16, 16), torch.tensor([0, 1] * 4)
    x[y == 1] += 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.5


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(ValueError, match=r"num_blocks=\.\.\.\) expects four ints >= 1; got \[2, 2\]"):
        resnet.ResNet(resnet.BasicBlock, [2, 2])
    with pytest.raises(ValueError, match="num_classes"):
        resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=0)
    with pytest.raises(ValueError, match=r"num_blocks=\.\.\.\) expects four ints >= 1; got 4"):  # no len() inside
        resnet.ResNet(resnet.BasicBlock, 4)
    with pytest.raises(ValueError, match=r"num_blocks=\.\.\.\) expects four ints >= 1; got \[1, True, 1, 1\]"):
        resnet.ResNet(resnet.BasicBlock, [1, True, 1, 1])


def test_numpy_ints_are_sizes_as_pythons_are():
    """``num_classes=labels.max() + 1`` is a numpy int: it was refused ("expects an int >= 1; got np.int64(4)")."""
    import numpy as np

    labels = np.array([0, 3, 1])
    model = resnet.ResNet(resnet.BasicBlock, np.array([1, 1, 1, 1]).tolist(), num_classes=labels.max() + 1)
    assert model(torch.zeros(2, 3, 8, 8)).shape == (2, 4)
    assert resnet.ResNet18({"num_classes": np.int64(3)})(torch.zeros(2, 3, 8, 8)).shape == (2, 3)  # 1.x config
