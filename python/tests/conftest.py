"""pytest setup: the package comes from a build tree (PYTHONPATH=<build>/python) or from
`pip install .`."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # moe_data

try:
    import torch
    import w4a8moe
except ImportError as e:  # a clear message instead of one error per test file
    raise pytest.UsageError(
        f"cannot import torch and w4a8moe ({e}); `pip install .` into the environment, or build "
        "with -DW4A8MOE_BUILD_TORCH=ON and run with PYTHONPATH=<build>/python and the "
        "interpreter torch was installed for"
    ) from e

# The plain-torch reference is many small element-wise ops: one thread runs them fastest and
# leaves the cores to the op, whose workers are set apart from torch's.
torch.set_num_threads(1)
w4a8moe.set_num_threads(os.cpu_count() or 1)


def pytest_report_header(config):
    return (f"torch {torch.__version__}, w4a8moe kernel set {w4a8moe.active_kernel_set()}, "
            f"{w4a8moe.get_num_threads()} threads; CPU: {w4a8moe.cpu_features()}")
