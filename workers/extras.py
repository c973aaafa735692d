"""Optional dependencies: imported where used, with a message naming the extra to install.

The core install (API, database, coordinator, reward worker, sim) needs none of them;
``pip install 'staleflow[demo]'`` brings the lot for the tiny-model demo.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Which extra of pyproject.toml brings each optional top-level module.
EXTRAS = {
    "torch": "torch",
    "safetensors": "torch",
    "matplotlib": "plots",
    "vllm": "vllm",
    "transformers": "hf",
    "tokenizers": "hf",
    "ray": "ray",
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def require(module: str) -> ModuleType:
    """Import `module`; if its distribution is missing, say which extra to install."""
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != top:  # a bug inside the package, not a missing install
            raise
        extra = EXTRAS[top]
        raise MissingExtra(
            f"{top} is not installed; it comes with the {extra!r} extra: pip install 'staleflow[{extra}]'",
            name=top,
        ) from None
