"""Recipes: which pass pipelines produce which format, for which op and dtype.

Kernel templates name the *format* they read (``Template.format``); the pipelines that prepare
it live here, with the pass options the measurements behind them chose.  The tuner offers every
recipe of a template's format (and each behind the generic reorderings).
"""
from __future__ import annotations

__all__ = ["WINDOW_REUSE", "ASPT_PANEL_HEIGHT", "LSH_SKIP_DENSE_RATIO", "pipelines_for"]

#: passes in front of a row-window format that cluster rows with common neighbours into the same
#: 16-row window (more nonzeros per gathered X row): RCM, then LSH clusters of 16 rows
WINDOW_REUSE = ({"name": "reorder.rcm", "options": {}},
                {"name": "cluster.lsh", "options": {"threshold_size": 16, "skip": False, "round": 1}})

#: rows of one ASpT panel (tall panels: more rows share a staged X row)
ASPT_PANEL_HEIGHT = 256
#: cluster.lsh round 1 in front of tile.aspt is skipped when the dense-tile ratio is already above
#: this: LSH only pays where the dense part is small (measured on the H100),
#: and the skip keeps the pass cheap on large graphs whose panels are dense anyway (tu_collab,
#: 24.5M entries: dense ratio 0.999, the ratio costs ~2 s, the clustering ~20 s)
LSH_SKIP_DENSE_RATIO = 0.8


def _sgt(shape: str) -> list[dict]:
    return [{"name": "tile.sgt", "options": {"shape": shape}}]


def _copy(pipes) -> list[list[dict]]:
    return [[{"name": p["name"], "options": dict(p.get("options", {}))} for p in pipe] for pipe in pipes]


def pipelines_for(fmt: str, op: str, dtype: str = "float32") -> list[list[dict]]:
    """The pipelines that produce format ``fmt`` for ``op`` with ``dtype`` inputs, first = default.

    * ``csr``: none (the canonical matrix).
    * ``sgt`` (TC-GNN's condensed 16-row windows): 16-wide blocks for 16-bit operands (and SDDMM),
      8-wide for TF32; alone or behind :data:`WINDOW_REUSE`.  16-bit inputs are MMA operands as
      they are, so only 16-wide blocks.
    * ``vnm`` (V:N:M for ``mma.sp``): RCM then the 16-row window condensation, with or without LSH
      clustering; the paper's V:N:M reordering; the condensation alone.
    * ``window`` (CSR read by row windows that stage their distinct columns): RCM first (it
      raises the columns rows of a window share), the plain order, RCM + LSH clustering.
    * ``aspt`` (ASpT panels): ``tile.aspt`` alone or behind LSH row clustering.
    """
    if fmt == "csr":
        return [[]]
    if fmt == "sgt":
        wide = "sddmm" if op == "sddmm" else "fp16"
        reuse = [*WINDOW_REUSE, *_sgt(wide)]
        if dtype != "float32":
            return _copy([_sgt(wide), reuse])
        if op == "sddmm":
            return _copy([_sgt(wide), _sgt("tf32"), reuse])
        return _copy([_sgt("tf32"), _sgt(wide), reuse])
    if fmt == "vnm":
        return _copy([[{"name": "reorder.rcm"}, {"name": "format.vnm"}],
                      [{"name": "reorder.rcm"}, WINDOW_REUSE[1], {"name": "format.vnm"}],
                      [{"name": "reorder.vnm", "options": {"V": 1, "N": 2, "M": 4}}],
                      [{"name": "format.vnm"}]])
    if fmt == "aspt":
        opts = {"panel_height": ASPT_PANEL_HEIGHT, "dense_threshold": 2}
        return _copy([[{"name": "tile.aspt", "options": dict(opts)}],
                      [{"name": "cluster.lsh", "options": {"panel_height": ASPT_PANEL_HEIGHT,
                                                           "skip_dense_ratio": LSH_SKIP_DENSE_RATIO}},
                       {"name": "tile.aspt", "options": dict(opts)}]])
    if fmt == "window":
        return _copy([[{"name": "reorder.rcm"}], [], list(WINDOW_REUSE)])
    raise ValueError(f"no recipe produces format {fmt!r}")
