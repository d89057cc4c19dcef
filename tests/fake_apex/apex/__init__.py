"""A stand-in for NVIDIA apex (which cannot be installed here): records what raysgd calls."""
