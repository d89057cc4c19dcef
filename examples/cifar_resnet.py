"""ResNet18 (or 34/50) on CIFAR-10 with Ray workers; CIFAR-shaped synthetic data unless you have the real files.

The code lives in :mod:`raysgd.torch.examples.cifar_pytorch_example` (the 1.x module path) and the
models in :mod:`raysgd.torch.resnet`. Without ``--data-dir`` the run uses 50,000 + 10,000
synthetic 3x32x32 images (nothing is downloaded); point ``--data-dir`` at the unpacked
``cifar-10-batches-py`` folder (the python version of CIFAR-10) to train on the real data.
A real-size run is meant for GPUs: ``--use-gpu --num-workers <GPUs> --fp16``.

    python examples/cifar_resnet.py --smoke-test                       # one epoch on 64 images
    python examples/cifar_resnet.py --num-workers 4 --use-gpu --fp16   # 5 epochs, real size
    python examples/cifar_resnet.py --data-dir ~/data/cifar-10-batches-py --use-gpu
"""
from raysgd.torch.examples.cifar_pytorch_example import main

if __name__ == "__main__":
    main()
