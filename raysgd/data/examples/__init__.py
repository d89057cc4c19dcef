"""RaySGD 1.x's ``ray.util.sgd.data.examples``: :mod:`raysgd.data.examples.mlp_identity`."""
