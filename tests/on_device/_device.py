"""The device the tests in this folder run on, and how they are marked.

They run on CUDA (marked ``gpu``: skipped without a GPU, see tests/conftest.py). With
``FO_TEST_DEVICE=cpu`` they run unmarked on the CPU instead: a dry run of the same checks on
a machine without a GPU, which shows that a failure on the GPU is the GPU's and not the test's.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("FO_TEST_DEVICE", "cuda"))
MARKS = [pytest.mark.gpu] if DEVICE.type == "cuda" else []
