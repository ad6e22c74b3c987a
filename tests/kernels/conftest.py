"""triton_kernels/ holds the Triton kernels' tests. They run where Triton runs its kernels: under its
interpreter on CPU (TRITON_INTERPRET=1 from process start; only the subprocess that
test_triton_interpreter.py starts sets it) or compiled on a CUDA GPU. Elsewhere they are not collected."""
import os

import torch

_RUNS_TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
collect_ignore = [] if _RUNS_TRITON else ["triton_kernels"]
