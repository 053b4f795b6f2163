"""benchmarks/short_gather.py's host side: the checksum its gather kernels are checked against,
the launch shape, and the report it computes from a bench JSON (the GPU part runs on the device;
its CUDA source is compiled here for sm_90 and sm_80)."""
import math
import os
import sys

import numpy as np
import pytest

from conftest import needs_nvcc, nvcc_cubin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import short_gather as sg  # noqa: E402


def test_host_checksum_is_the_xor_of_every_row_read():
    rng = np.random.default_rng(3)
    X = rng.integers(0, 2**32, (37, 12), dtype=np.uint32)
    cols = rng.integers(0, 37, 500).astype(np.int32)
    want = 0
    for c in cols:                    # what a kernel folding every row it reads into one word gets
        for w in X[c]:
            want ^= int(w)
    assert sg.host_checksum(X, cols) == want
    assert sg.host_checksum(X, np.array([4, 4], np.int32)) == 0      # a row read twice cancels
    assert sg.host_checksum(X, np.array([5], np.int32)) == int(np.bitwise_xor.reduce(X[5]))


def test_launch_shape():
    assert [sg.lanes_for(r) for r in (1, 2, 3, 8, 16, 48, 64)] == [1, 2, 2, 8, 16, 32, 32]
    assert sg.resident_blocks(32) == 8 and sg.resident_blocks(38) == 6 and sg.resident_blocks(255) == 1
    assert sg.resident_blocks(1) == 8


def _bench(dtype="float16"):
    def row(g, K, t, b, floor, l2):
        cols = {"default": {"status": "ok", "seconds": t}, "baseline": {"status": "ok", "seconds": 2 * b},
                "baseline_fp32": {"status": "ok", "seconds": b}}
        return {"graph": g, "n": 1000, "m": 1000, "nnz": 50000, "K": K, "floor_s": floor, "l2_floor_s": l2, "columns": cols}
    rows = [row("a", 64, 10e-6, 40e-6, 2e-6, 5e-6), row("b", 64, 20e-6, 40e-6, 8e-6, 4e-6),
            row("c", 128, 20e-6, 40e-6, 8e-6, 4e-6)]
    rows.append({**row("d", 64, 1e-6, 1e-6, 1e-6, 1e-6), "columns": {"default": {"status": "failed"}}})
    return {"name": "t", "settings": {"dtype": dtype, "n_sets": 3}, "rows": rows}


def test_rows_and_summary():
    rows = sg.rows_of(_bench(), "default", "baseline_fp32")
    assert [r["graph"] for r in rows] == ["a", "b", "c"]                      # the failed row is left out
    assert rows[0]["row_bytes"] == 128 and sg.rows_of(_bench("float32"), "default", "baseline")[0]["row_bytes"] == 256
    for r, sgs in zip(rows, (7e-6, 5e-6, 6e-6)):
        r["short_gather_s"], r["unroll"] = sgs, 4
    s = sg.summarize(rows)
    assert s["64"]["graphs"] == 2 and s["128"]["graphs"] == 1
    assert s["64"]["x"] == pytest.approx(math.sqrt(4 * 2))
    assert s["64"]["x_at_floor"] == pytest.approx(math.sqrt(8 * 5))
    # short bound: the larger of the HBM floor and the short gather time (7 us on a, 8 us on b)
    assert s["64"]["x_at_short_bound"] == pytest.approx(math.sqrt(40 / 7 * 40 / 8))
    assert s["128"]["short_bound_frac"] == pytest.approx(8 / 20)
    md = sg.markdown({"name": "t_short", "device": "GPU", "command": "cmd", "date": "now", "bench_name": "t",
                      "column": "default", "over": "baseline_fp32", "empty_kernel_s": 2e-6, "rows": rows, "summary": s})
    assert "| 64 | 2 | 2.83 | 6.32 | 5.35 | " in md and "| a | 50000 | 1000 | 64 | 2.0 | 5.0 | 7.0 | 4 |" in md


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_gather_kernel_compiles(tmp_path, arch):
    for lanes, u, row16 in ((8, 8, 8), (2, 1, 3), (32, 4, 64)):
        nvcc_cubin(tmp_path, sg.SOURCE, {"SG_LANES": lanes, "SG_U": u, "SG_ROW16": row16}, arch)


def test_bulk_launch_shape():
    # four warps of stages x chunk rows each, a block within 200 KB of shared memory
    assert sg.bulk_warps(128, 2, 32) == 4                   # 32 KB a block
    assert sg.bulk_warps(1024, 2, 32) == 3                  # 64 KB a warp
    assert sg.bulk_warps(1024, 8, 32) == 0                  # one warp's stages alone exceed it
    assert sg.bulk_warps(1024, 4, 8) == 4
    assert sg.bulk_warps(512, 4) == sg.bulk_warps(512, 4, 32) == 3


def test_markdown_with_bulk_columns():
    rows = sg.rows_of(_bench(), "default", "baseline_fp32")
    for r in rows:
        r["short_gather_s"], r["unroll"] = 7e-6, 8
    rows[0].update(bulk_gather_s=6e-6, bulk_stages=2, bulk_chunk=16)     # the others: no shape fitted
    doc = {"name": "t_bulk", "device": "GPU", "command": "cmd", "date": "now", "bench_name": "t", "column": "default",
           "over": "baseline_fp32", "empty_kernel_s": 2e-6, "rows": rows, "summary": sg.summarize(rows),
           "bulk_stages": [1, 2], "bulk_chunks": [16, 32]}
    md = sg.markdown(doc)
    assert "S = 1/2 chunks of C = 16/32 rows" in md
    assert "| a | 50000 | 1000 | 64 | 2.0 | 5.0 | 7.0 | 8 | 6.0 | 2, 16 | 10.0 |" in md
    assert "| b | 50000 | 1000 | 64 | 8.0 | 4.0 | 7.0 | 8 | - | - | 20.0 |" in md
    # without bulk measurements the table keeps its columns
    doc.pop("bulk_stages")
    assert "bulk gather" not in sg.markdown(doc) and "| a | 50000 | 1000 | 64 | 2.0 | 5.0 | 7.0 | 8 | 10.0 |" in sg.markdown(doc)


@needs_nvcc
def test_bulk_gather_kernel_compiles(tmp_path):
    # cp.async.bulk and mbarrier transaction counts are sm_90 instructions: the kernel is Hopper-only
    for w, s, rb, c in ((4, 2, 128, 32), (1, 1, 1024, 8), (3, 4, 256, 16)):
        nvcc_cubin(tmp_path, sg.BULK_SOURCE, {"BG_W": w, "BG_S": s, "BG_RB": rb, "BG_C": c})
