"""Writing cache files so that no reader ever sees half of one."""
from __future__ import annotations

import os
import tempfile


def write_atomically(path: str, data: bytes, suffix: str = "", mode: int = 0o644) -> str:
    """Write ``data`` to ``path`` through a temporary file in the same folder and an atomic
    rename (concurrent writers of the same content are harmless); returns ``path``."""
    fd, part = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".part-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(part, mode)
        os.replace(part, path)
    except BaseException:
        try:
            os.remove(part)
        except OSError:
            pass
        raise
    return path
