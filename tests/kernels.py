"""Kernel variants the suite can run under, to see a test that only passes where the
machine rounds like the one that wrote it (tests/tolerance.py has the rule).

Set in the environment, so that the worker processes the tests start take them too:

- ``ATEN_CPU_CAPABILITY=default`` (read by torch itself): ATen's scalar kernels instead of
  its AVX2/AVX-512 ones;
- ``SLSAM_TEST_MKLDNN=0``: ``torch.backends.mkldnn`` off (oneDNN's convolutions and
  matmuls fall back to ATen's);
- ``SLSAM_TEST_THREADS=1``: one intra-op thread instead of two (reductions split
  differently).

``make test-kernels`` runs the stored-reference tests under all three at once.
"""

from __future__ import annotations

import getpass
import os
import tempfile

import torch


def apply() -> None:
    """Apply the variant the environment asks for (a no-op by default)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability:
        # Inductor caches its precompiled C++ headers under a key without the capability: a
        # header built under AVX-512 fails to compile under "default" ("'at::vec' has not
        # been declared"). One cache per capability.
        folder = f"torchinductor_{getpass.getuser()}_{capability}"
        os.environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), folder)
        )
    if os.environ.get("SLSAM_TEST_MKLDNN") == "0":
        torch.backends.mkldnn.enabled = False
    threads = os.environ.get("SLSAM_TEST_THREADS")
    torch.set_num_threads(int(threads) if threads else min(2, torch.get_num_threads()))
