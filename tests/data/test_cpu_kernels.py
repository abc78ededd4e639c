"""torch's CPU kernels are pinned before the entry points load torch (data/cpu_kernels.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data import REPO, cpu_kernels


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


x86_with_avx2 = pytest.mark.skipif(not cpu_kernels.on_x86_64() or "avx2" not in cpu_flags(),
                                   reason="the pin is for x86-64 CPUs with AVX2")


def capability_after_importing(entry: str, **env: str) -> str:
    """torch's kernel set in a fresh interpreter that imports the entry point first, as `python
    ENTRY.py` does, with none of the pinned variables set unless given."""
    clean = {k: v for k, v in os.environ.items() if k not in cpu_kernels.PINNED}
    code = f"import {entry}, torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**clean, **env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


@x86_with_avx2
@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_entry_points_run_torch_on_avx2_kernels(entry):
    # on an AVX512 machine (this one) torch would otherwise pick AVX512, and train another predictor
    assert capability_after_importing(entry) == "AVX2"


@pytest.mark.skipif(not cpu_kernels.on_x86_64() or "avx512f" not in cpu_flags(),
                    reason="torch picks other kernels than the pinned ones only where the CPU has AVX512")
def test_a_pin_after_torch_ran_a_kernel_says_the_kernels_are_not_pinned():
    clean = {k: v for k, v in os.environ.items() if k not in cpu_kernels.PINNED}

    def pinned_after(setup: str) -> subprocess.CompletedProcess:
        code = (f"import warnings; warnings.simplefilter('error'); {setup}; "
                "from data import cpu_kernels; cpu_kernels.pin()")
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**clean, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=300)

    late = pinned_after("import torch; torch.ones(8).sum()")  # the kernel set is fixed: AVX512 here
    assert late.returncode != 0 and "torch ran a kernel before data.cpu_kernels.pin()" in late.stderr
    assert pinned_after("import torch").returncode == 0  # loaded, but no kernel run yet: the pin still holds


@x86_with_avx2
def test_a_users_own_setting_is_kept():
    assert capability_after_importing("evaluate", ATEN_CPU_CAPABILITY="default") == "DEFAULT"


def test_this_process_is_pinned_and_says_so():
    # conftest pins before any test imports torch: trainings here are those of train.py
    fingerprint = cpu_kernels.fingerprint()
    if cpu_kernels.on_x86_64():
        assert fingerprint["mkl_cbwr"] == os.environ["MKL_CBWR"] and os.environ["MKL_CBWR"]
        assert fingerprint["onednn_max_cpu_isa"] == os.environ["ONEDNN_MAX_CPU_ISA"]
        if "avx2" in cpu_flags():
            assert fingerprint["torch_cpu_capability"] == os.environ["ATEN_CPU_CAPABILITY"].upper()
