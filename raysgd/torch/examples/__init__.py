"""Example modules that 1.x programs and tests import (``train_example`` and friends)."""
