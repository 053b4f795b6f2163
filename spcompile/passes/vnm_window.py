"""``format.vnm``: attach the V:N:M description (``formats["vnm"]``, see ``reorder.vnm``) of the
matrix in its current order, without reordering.

The window-condensed packing of ``sptc.vnm`` (``pack="condensed"``) makes every 16 x 32 tile 2:4 by
construction (per 16-row window it renumbers the window's distinct columns into 4-column groups
that hold at most 2 entries of any row), so it needs no SOGRE renumbering; what it wants is row
locality (rows sharing columns in the same window), e.g. ``reorder.rcm`` before this pass.
"""
from __future__ import annotations

from .base import Pass, register_pass
from .reorder_vnm import vnm_format


@register_pass("format.vnm")
class VNMFormat(Pass):
    """The V:N:M format description of the current order (no renumbering)."""

    default_options = {"V": 1, "N": 2, "M": 4}
    produces = ("vnm",)

    def transform(self, mod, ctx):
        o = self.options
        fmt = vnm_format(mod.A, int(o["V"]), int(o["N"]), int(o["M"]))
        out = mod.with_format("vnm", fmt)
        return out.with_metrics(self.name, {"violations": fmt["violations"], "conforms": fmt["conforms"]})
