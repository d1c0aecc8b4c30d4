"""How files are written: made durable (:func:`fsync`, before a rename publishes them), and
safetensors files readable as the process's umask says (safetensors creates its files readable by
their owner only, where a model directory is for others to load too)."""

from __future__ import annotations

import os


def fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # (where /proc does not say: read by setting, at once set back)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict, path, metadata=None) -> None:
    """safetensors' ``save_file``, the file then given the mode any file this process creates gets
    (``0o666`` less the umask): safetensors creates it readable by its owner only, where the run's
    other outputs (and a model directory others load) are readable as the umask says."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())
