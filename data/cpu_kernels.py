"""torch's CPU kernels pinned to one instruction set, so that which kernels a trained predictor
(and every number that depends on it) ran does not depend on whether the machine has AVX512.

The bits are still the CPU model's: MKL picks its code path by vendor too (on AMD, MKL_CBWR=AVX2
gives CNR:AUTO, not its AVX2 branch), and its sqrt rests on an approximate instruction whose bits
are the CPU's own; under an emulator, an Intel and an AMD AVX2 model trained different predictors
(docs/predictors.md, Notes).

torch, MKL and oneDNN each pick their kernels by the CPU they find (AVX512 where the CPU has it,
AVX2 otherwise), and the kernels sum in different orders: measured on an AVX512 machine, the same
graphsage training (hover, seed 0) gives other metrics when any one of the three is held to AVX2
(69 to 76 of its 98 metrics differ; test top-1 at k=2 0.862 against 0.858-0.859), and the same
metrics again on every rerun with the same settings. The simulator's own numpy arithmetic was
checked too: a replay gives the same summary with numpy's AVX512 loops disabled, so only torch is
pinned.

The variables are read once, when each library first runs a kernel, so `pin()` runs before torch
is imported: first thing in train.py, evaluate.py and the tests' conftest (this package's
``__init__`` imports nothing heavy, which is why the pin lives here). A variable the user already
set is kept. Other CPUs (ARM) are left as they are: their kernels differ anyway.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorised kernels (reductions, activations, softmax)
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: its AVX2 code path (Intel CPUs)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's JIT kernels (linear layers, convolutions)
}


def on_x86_64() -> bool:
    """Whether this machine is x86-64, the only kind `pin()` pins."""
    return platform.machine().lower() in ("x86_64", "amd64")


def pin() -> None:
    """Set each of PINNED in the environment where the user has not, on x86-64 (child processes
    inherit it). torch fixes its kernel set when it first runs one; where that happened before the
    pin with another set (a script or notebook that imported, say, the cache policies first: their
    import runs a torch kernel), it warns: predictors trained in the process, and the replays
    they drive, then differ from the entry points'."""
    if not on_x86_64():
        return
    for name, value in PINNED.items():
        os.environ.setdefault(name, value)
    torch = sys.modules.get("torch")
    if torch is not None:
        running, wanted = torch.backends.cpu.get_cpu_capability(), os.environ["ATEN_CPU_CAPABILITY"].upper()
        if running != wanted:
            warnings.warn(f"torch ran a kernel before data.cpu_kernels.pin() and runs {running} kernels, not "
                          f"{wanted}: predictors trained in this process differ from train.py's (call pin() "
                          f"before anything uses torch; data/cpu_kernels.py)", RuntimeWarning, stacklevel=2)


def fingerprint() -> dict:
    """What decides torch's CPU floats beyond the inputs and package versions: the kernel set torch
    runs and MKL's and oneDNN's settings. Cache keys of trained predictors and text encodings
    include it; metrics.json records it."""
    import torch

    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **{name.lower(): os.environ.get(name) for name in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}}
