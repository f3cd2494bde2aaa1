"""Root test configuration, loaded before any test module.

Triton reads TRITON_INTERPRET when it is first imported, so it is set here: without a GPU, every Triton
kernel in the test session runs in the interpreter (CPU). With CUDA present, kernels run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
