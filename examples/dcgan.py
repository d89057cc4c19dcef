"""DCGAN on the 8x8 digits: two models, two optimizers and a custom ``train_batch`` on Ray workers.

The code lives in :mod:`raysgd.torch.examples.dcgan` (the 1.x module path, so
``from ray.util.sgd.torch.examples.dcgan import GANOperator`` keeps working); read it there.
Each step trains the discriminator on real and generated digits, then the generator against it,
through ``self.autocast()`` and ``self.backward_and_step(loss, optimizer)``; the "inception"
metric scores the generated digits with a classifier trained on the real ones.

    python examples/dcgan.py                     # 30 epochs on 2 workers
    python examples/dcgan.py --smoke-test        # one epoch on 512 images
    python examples/dcgan.py --fp16 bf16 --samples generated.png
"""
from raysgd.torch.examples.dcgan import main

if __name__ == "__main__":
    main()
