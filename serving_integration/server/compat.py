"""Import SGLang 0.5.23's cache modules beside the CPU build of torch 2.13.0.

`sglang.srt.configs` imports torchvision at module level (for multimodal models), and PyPI's
torchvision does not load beside the CPU torch 2.13.0 this project pins (docs/install.md).
The choice made here: an import guard rather than a 5.5 GB CUDA torch 2.14.1 + torchvision
0.29.1 stack. When torchvision cannot be imported, `install_torchvision_guard()` registers a
placeholder package: importing it and reading attributes works, calling anything from it raises
ImportError naming the reason. Nothing the KV cache or this project's plugin uses touches it. On a
GPU machine with the full sglang install, torchvision imports and the guard does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

GUARDED = "torchvision"


class _Missing:
    """Stands for any torchvision attribute; using it raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name} needs torchvision, which is not installed beside the CPU "
                          "torch 2.13.0 build (serving_integration.server.compat guard)")

    def __mro_entries__(self, bases):
        return (object,)


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _TorchvisionGuard(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == GUARDED or fullname.startswith(GUARDED + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        module.__version__ = "0.0.0+pbkv-guard"


def install_torchvision_guard() -> bool:
    """Install the placeholder if torchvision cannot be imported; True if it was installed."""
    if any(isinstance(f, _TorchvisionGuard) for f in sys.meta_path):
        return True
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:  # a missing or a broken install (operator torchvision::nms does not exist)
        for name in [m for m in sys.modules if m == GUARDED or m.startswith(GUARDED + ".")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _TorchvisionGuard())
        return True


# -------------------------------------------------------------------- HiCache on a CPU-only machine


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int = 1) -> None:
    """Pure-torch `transfer_kv_direct` (the `direct` io backend, layer-first layout): for each
    (src, dst) buffer pair, `dst[dst_indices] = src[src_indices]`. Token indices already expand
    pages, so `page_size` needs no handling here."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source buffers, {len(dst_layers)} destinations")
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.dtype)


def _no_host_register(buffer, registration_granularity_bytes=None) -> None:
    """cudaHostRegister has nothing to register on a machine without CUDA."""


def apply_cpu_hicache_fixes() -> bool:
    """Make SGLang 0.5.23's HiCache host pool work without CUDA; True if applied, False with CUDA.

    Its host pool is always allocated with pin_memory=True, and `pool_host.common._cuda_host_register`
    then calls into CUDA: made a no-op. `pool_host.mha` imports its transfer functions only on
    CUDA/HIP/XPU: given the pure-torch `transfer_kv_direct` above (`--hicache-io-backend direct
    --hicache-mem-layout layer_first`). Applied before the scheduler builds the cache (the plugin's
    register(); docs/serving.md, "SGLang on a CPU")."""
    import torch

    if torch.cuda.is_available():
        return False
    from sglang.srt.mem_cache.pool_host import common, mha

    common._cuda_host_register = _no_host_register
    if not hasattr(mha, "transfer_kv_direct"):
        mha.transfer_kv_direct = transfer_kv_direct
    return True
