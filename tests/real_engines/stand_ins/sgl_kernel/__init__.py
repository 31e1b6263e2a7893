"""Stand-in for ``sgl_kernel`` in the real-engine tier's SGLang (test tooling, never shipped).

SGLang 0.5.23 started with ``SGLANG_USE_CPU_ENGINE=1`` imports its CPU kernels from
``sgl_kernel`` at module level, and their CPU build comes only with SGLang's source, which
PyPI does not carry (the ``sglang-kernel`` wheel is a GPU build that does not load here).
For a dense Qwen3 on ``--attention-backend torch_native`` without speculative decoding none
of them runs (seen: ``assign_req_to_token_pool_cpu``, ``copy_all_layer_kv_cache_cpu`` and
the speculative ``*_cpu`` helpers are imported, never called). Every name is a function that
raises, naming itself, so a call would fail loudly rather than compute something else.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def not_here(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is not in the test tier's stand-in")

    not_here.__name__ = name
    return not_here
