"""Imports deferred in the worker: what mlx-audio imports and Qwen3-TTS never uses.

`worker/__init__.py` applies it before any worker module imports mlx-audio.
"""

from __future__ import annotations

import importlib.util
import sys

# Modules that mlx-audio imports on the way to Qwen3-TTS and Qwen3-TTS never uses: its codec
# package imports every codec, and one of them (MiMo's resampler) imports scipy.signal at the top,
# about half of a handler worker's start on a CPU (1.7 s of 3.5 s measured here). They load on
# first use instead (`python -X importtime` shows the chain).
DEFERRED_IMPORTS = ("scipy.signal",)


def defer_unused_imports(names: tuple[str, ...] = DEFERRED_IMPORTS) -> list[str]:
    """Make each module in `names` import lazily (Python's LazyLoader: the module's code runs at
    its first attribute access), unless it is imported already. Returns the ones deferred."""
    deferred = []
    for name in names:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or spec.loader is None:
            continue
        spec.loader = importlib.util.LazyLoader(spec.loader)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        parent, _, child = name.rpartition(".")
        if parent:  # `from scipy import signal` reads the attribute of the parent package
            setattr(sys.modules[parent], child, module)
        deferred.append(name)
    return deferred
