"""Stand-in for `sgl_kernel` on a CPU-only machine (README.md beside this module).

Any attribute of this module is a function that raises NotImplementedError when called, so that
`from sgl_kernel import X` (done at import time by some sglang modules) succeeds and a call that
would need the real kernel fails loudly. It has no submodules: `from sgl_kernel.scalar_type import
...` raises ImportError, and sglang's modules that guard such imports take their own fallbacks.
"""

from __future__ import annotations

__version__ = "0.0.0+pbkv-cpu-stand-in"


def _stub(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} needs the real sgl_kernel, which has no CPU build on "
                                  "PyPI (this is the PBKV CPU stand-in, serving_integration/server/cpu_support)")

    missing.__name__ = missing.__qualname__ = name
    return missing


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    value = globals()[name] = _stub(name)
    return value
