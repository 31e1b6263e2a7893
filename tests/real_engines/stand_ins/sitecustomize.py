"""Stand-in for CUDA host registration in the real-engine tier's SGLang (test tooling).

SGLang 0.5.23's routed-experts capture (``--enable-return-routed-experts``) keeps its host
buffer pinned: ``mem_cache/pool_host/common.py`` registers the buffer's pages with
``torch.cuda.cudart().cudaHostRegister``, which a CPU-only torch cannot give. On the CPU
there is no device to transfer to, so registering is a no-op here: the buffer is plain
memory, which is all the CPU path reads. Nothing else of SGLang calls ``cudart``.
Loaded by Python at start-up because ``stand_ins`` is on SGLang's ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any


class _NoDeviceRuntime:
    """``cudart`` for a process without CUDA: host registration succeeds and does nothing."""

    @staticmethod
    def cudaHostRegister(pointer: int, size: int, flags: int) -> int:  # noqa: N802
        return 0

    @staticmethod
    def cudaHostUnregister(pointer: int) -> int:  # noqa: N802
        return 0

    @staticmethod
    def cudaGetErrorString(code: int) -> str:  # noqa: N802
        return f"error {code}"


class _PatchTorchCuda(importlib.abc.MetaPathFinder):
    """Once ``torch.cuda`` is imported, give a CPU-only torch the no-op runtime."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "sglang.srt.mem_cache.pool_host.common" and "torch" in sys.modules:
            torch = sys.modules["torch"]
            if not torch.cuda.is_available():
                torch.cuda.cudart = _NoDeviceRuntime
            sys.meta_path.remove(self)
        return None


sys.meta_path.insert(0, _PatchTorchCuda())
