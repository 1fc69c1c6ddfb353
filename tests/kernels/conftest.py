import os

import torch

# On a CUDA machine (benchmarks/gpu_check.py) the same tests run on the GPU, compiled.
if os.environ.get("ACTORLM_TEST_DEVICE", "cpu") != "cpu":
    torch.set_default_device(os.environ["ACTORLM_TEST_DEVICE"])
