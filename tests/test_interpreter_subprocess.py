"""On a CUDA machine, the tests that run Triton on CPU tensors, in a child process where the interpreter is on.

Triton's interpreter is chosen when triton is first imported, so one process cannot run it beside compiled
CUDA kernels; conftest deselects those tests in a CUDA process and this test runs them with CUDA hidden.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="without CUDA the interpreter tests run in-process")
def test_interpreter_tests_pass_with_cuda_hidden():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "interpreter", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
