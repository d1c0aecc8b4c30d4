"""Access to the compiled module ``hytrain_native``.

A missing or broken native build raises a helpful ImportError on first use rather than at
``import hytrain``, so the pure-Python parts (configuration, checks) stay importable.
"""

from __future__ import annotations

_native = None
_import_error: Exception | None = None

try:
    import hytrain_native as _native  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _import_error = exc


def native():
    """Returns the ``hytrain_native`` module or raises ImportError explaining how to build it."""
    if _native is None:
        raise ImportError(
            "hytrain's native module 'hytrain_native' could not be imported "
            f"({_import_error}). Build it with `pip install .` (or `pip install -e . "
            "--no-build-isolation` for development) from the repository root."
        )
    return _native
