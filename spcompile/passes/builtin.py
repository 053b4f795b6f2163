"""Imports every pass module shipped with spcompile so that they register themselves."""
from . import reorder_simple  # noqa: F401

# The papers' passes register here when present (issue: preprocessing passes).
for _name in ("reorder_vnm", "cluster_lsh", "tile_aspt", "tile_sgt", "vnm_window"):
    try:
        __import__(f"{__package__}.{_name}")
    except ModuleNotFoundError as e:  # only a missing module is tolerated, not a broken one
        if e.name != f"{__package__}.{_name}":
            raise
