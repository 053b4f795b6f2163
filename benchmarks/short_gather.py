"""Gather-only kernels of a graph's size: how long the GPU takes, under the one timing rule, to
read one random row of X per nonzero for a graph of a benchmark table -- nothing else.

``benchmarks/l2_gather.py`` measures the L2 gather rate with launches of ~0.5 ms, and the tables'
"l2 floor" divides a graph's gathered bytes by it.  A kernel of 5-20 us (16-bit X at K=64 on the
graphs over 200k nonzeros) does not reach that rate: the launch inside a CUDA graph, the ramp of
the first wave and the tail of the last cost a few microseconds whatever the kernel does.  This
script times, for every (graph, K) row of a ``bench.py`` JSON, the fastest of a few gather-only
kernels that read ``nnz`` rows of ``K`` elements (the table's dtype) in uniformly random order
from an X of the graph's ``n`` rows, with the ``Timer("cuda")`` rule of the product (CUDA-graph
replay between events, median of repeats), and reports it beside the table's floors and times:

* ``short gather us``: that time (what the table's L2 gather rate becomes in a kernel of this
  length; no sparse structure, values, sums or output).  A reference, not a floor: more rows in
  flight (``--unrolls``) may be faster still, and kernels that reuse gathered rows or read X in a
  local order can beat it;
* ``x at short bound``: the baseline's time over the larger of it and the HBM compulsory floor,
  the speed-up a kernel running exactly at that bound would reach.

The kernels: ``LANES`` lanes per nonzero (one 16-byte load each per 16 bytes of the row, up to 32
lanes), ``U`` nonzeros' column ids then rows loaded before any is used (U x the row's loads in
flight per lane), as many 256-thread blocks as the GPU holds at once (from the kernel's registers), grid-stride over the nonzeros; each
lane folds what it read into one word by XOR, and the result is checked against the host's XOR of
the rows read an odd number of times (a check that every row was read).

``--bulk-stages S ... [--bulk-chunks C ...]`` also times, for every row, a kernel that moves the
same rows with Hopper bulk copies (``BULK_SOURCE``: one ``cp.async.bulk`` a row into shared memory,
chunks of C rows completing on an mbarrier, S chunks in flight a warp; sm_90 only), reported
beside the load kernels and not used for the bound.

    python benchmarks/short_gather.py --bench docs/benchmarks/h100_spmm_fp16_default_big.json --out DIR
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import prototype  # noqa: E402  (the bulk-copy helpers, the resident block count)

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256) short_gather(
    const uint4* __restrict__ X, const int* __restrict__ cols, long long nnz, unsigned* sink)
{
    // SG_LANES lanes share a nonzero; lane g reads the 16-byte words g, g + SG_LANES, ... of its
    // row (SG_ROW16 words a row, at most WPL a lane); SG_U nonzeros' ids, then their rows, in flight
    constexpr int LANES = SG_LANES, U = SG_U, ROW16 = SG_ROW16, WPL = (ROW16 + LANES - 1) / LANES;
    const int g = threadIdx.x % LANES;
    const long long slot = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / LANES;
    const long long nslots = (long long)gridDim.x * blockDim.x / LANES;
    unsigned acc = 0u;
    for (long long e0 = slot; e0 < nnz; e0 += nslots * U) {
        int c[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long e = e0 + u * nslots;
            c[u] = e < nnz ? __ldg(cols + e) : -1;
        }
        uint4 v[U][WPL];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int w = 0; w < WPL; ++w)
                v[u][w] = (c[u] >= 0 && g + w * LANES < ROW16) ? __ldg(X + (long long)c[u] * ROW16 + g + w * LANES)
                                                               : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int w = 0; w < WPL; ++w) acc ^= v[u][w].x ^ v[u][w].y ^ v[u][w].z ^ v[u][w].w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0 && acc) atomicXor(sink, acc);
}
"""

BULK_SOURCE = prototype.CUDA_BULK_HELPERS + r"""
extern "C" __global__ void __launch_bounds__(BG_W * 32) bulk_gather(
    const unsigned char* __restrict__ X, const int* __restrict__ cols, long long nnz, unsigned* sink)
{
    // each warp streams chunks of BG_C <= 32 nonzeros: lane l < BG_C copies row cols[e] (BG_RB
    // bytes) to its slot of the chunk's stage with one cp.async.bulk (TMA), completing on the
    // stage's mbarrier; BG_S stages in flight a warp; the warp then folds the chunk's rows from
    // shared memory by XOR
    constexpr int W = BG_W, S = BG_S, RB = BG_RB, R16 = RB / 16, C = BG_C;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[W * S];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned char* buf = smem + (size_t)warp * S * C * RB;
    const unsigned bar0 = (unsigned)__cvta_generic_to_shared(bars + warp * S);
    const unsigned buf0 = (unsigned)__cvta_generic_to_shared(buf);
    if (lane < S) mbar_init(bar0 + 8 * lane);
    mbar_init_fence();
    __syncwarp();
    const long long nchunks = (nnz + C - 1) / C;
    const long long c0 = (long long)blockIdx.x * W + warp, nw = (long long)gridDim.x * W;
    auto issue = [&](long long c, int s) {
        const long long e = c * C + lane;
        const int col = (lane < C && e < nnz) ? __ldg(cols + e) : -1;
        const unsigned cnt = __popc(__ballot_sync(0xffffffffu, col >= 0));
        if (lane == 0) mbar_expect(bar0 + 8 * s, cnt * RB);
        __syncwarp();
        if (col >= 0) bulk_copy(buf0 + (unsigned)((s * C + lane) * RB), X + (long long)col * RB, RB, bar0 + 8 * s);
    };
#pragma unroll
    for (int s = 0; s < S; ++s)
        if (c0 + s * nw < nchunks) issue(c0 + s * nw, s);
    unsigned acc = 0u, phases = 0u;
    int s = 0;
    for (long long c = c0; c < nchunks; c += nw) {
        mbar_wait(bar0 + 8 * s, (phases >> s) & 1u);
        phases ^= 1u << s;
        const int cnt = (int)min((long long)C, nnz - c * C);
        const uint4* rows = reinterpret_cast<const uint4*>(buf + (size_t)s * C * RB);
        for (int j = lane; j < cnt * R16; j += 32) {
            const uint4 v = rows[j];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        async_proxy_fence();
        if (c + S * nw < nchunks) issue(c + S * nw, s);
        s = (s + 1 == S) ? 0 : s + 1;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0 && acc) atomicXor(sink, acc);
}
"""

#: nonzeros in flight per lane tried for every row
UNROLLS = (1, 2, 4, 8)
ELEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def lanes_for(row16: int) -> int:
    """Lanes per nonzero: the largest power of two up to the row's 16-byte words and a warp."""
    g = 1
    while 2 * g <= min(32, row16):
        g *= 2
    return g


def resident_blocks(regs: int) -> int:
    """256-thread blocks of a kernel of ``regs`` registers a thread (no shared memory) that one SM
    holds at once (``prototype.resident_blocks``): one wave of the grid."""
    return prototype.resident_blocks(8, 0, regs)


def host_checksum(X32: np.ndarray, cols: np.ndarray) -> int:
    """XOR of every 32-bit word of the rows of ``X32`` (uint32, one row per X row) that ``cols``
    names an odd number of times: what the kernel's XOR of all rows it read comes to."""
    odd = np.flatnonzero(np.bincount(cols, minlength=X32.shape[0]) & 1)
    if not odd.size:
        return 0
    return int(np.bitwise_xor.reduce(X32[odd].ravel()))


class _Gathers:
    """What every gather kernel of one size reads and is checked against: ``nnz`` random column
    ids out of ``n``, ``n_sets`` copies of X (``row_bytes`` a row, a multiple of 16) at distinct
    addresses, the host's checksum of the rows read, a sink word, and the Timer."""

    def __init__(self, n: int, nnz: int, row_bytes: int, n_sets: int = 1, seed: int = 0, repeats: int = 10):
        import cupy as cp
        import torch

        from spcompile.autotune.measure import Timer

        if row_bytes % 16:
            raise ValueError(f"rows of {row_bytes} bytes: the gather kernels move 16-byte words")
        rng = np.random.default_rng(seed)
        X32 = rng.integers(0, 2**32, (n, row_bytes // 4), dtype=np.uint32)
        cols_h = rng.integers(0, n, nnz, dtype=np.int32)
        self.n, self.nnz, self.row_bytes = n, nnz, row_bytes
        self.want = host_checksum(X32, cols_h)
        X = torch.from_numpy(X32.view(np.int32)).cuda()
        self._keep = [X] + [X.clone() for _ in range(max(1, int(n_sets)) - 1)] + [torch.from_numpy(cols_h).cuda()]
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.Xc = [cp.asarray(x) for x in self._keep[:-1]]
        self.colsc, self.sinkc = cp.asarray(self._keep[-1]), cp.asarray(self.sink)
        self.sms = int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
        self.timer = Timer("cuda", repeats=repeats)

    def time(self, kern, blocks: int, threads: int, what: str, shared_mem: int = 0) -> float:
        """Kernel time of ``kern`` over the X copies by the Timer rule, after one call whose checksum
        must match the host's (RuntimeError naming ``what`` otherwise)."""
        import torch

        from spcompile.runtime.cuda import _stream

        args = [(x, self.colsc, np.int64(self.nnz), self.sinkc) for x in self.Xc]

        def launch(i):
            kern((blocks,), (threads,), args[i], shared_mem=shared_mem,
                 stream=_stream(torch.cuda.current_stream().cuda_stream))

        self.sink.zero_()
        launch(0)
        torch.cuda.synchronize()
        got = int(self.sink.item()) & 0xFFFFFFFF
        if got != self.want:
            raise RuntimeError(f"{what}: checksum {got:#x}, expected {self.want:#x}")
        return self.timer.time(launch, len(args)).seconds


def measure(n: int, nnz: int, row_bytes: int, n_sets: int = 1, seed: int = 0, repeats: int = 10,
            unrolls=UNROLLS) -> dict:
    """The fastest of the ``UNROLLS`` gather kernels for ``nnz`` random rows of ``row_bytes``
    (a multiple of 16) out of ``n``, under the Timer rule with calls rotating over ``n_sets``
    copies of X at distinct addresses (as the benchmark's Timer rotates over its input sets);
    every variant's result checked."""
    import cupy as cp

    g = _Gathers(n, nnz, row_bytes, n_sets, seed, repeats)
    row16 = row_bytes // 16
    lanes = lanes_for(row16)
    out, grid = {}, {}
    for U in unrolls:
        kern = cp.RawKernel(SOURCE, "short_gather", options=(f"-DSG_LANES={lanes}", f"-DSG_U={U}", f"-DSG_ROW16={row16}"))
        grid[U] = g.sms * resident_blocks(int(kern.num_regs))
        out[U] = g.time(kern, grid[U], 256, f"gather kernel U={U}")
    best = min(out, key=out.get)
    return {"n": n, "nnz": nnz, "row_bytes": row_bytes, "n_sets": len(g.Xc), "lanes": lanes, "blocks": grid[best],
            "seconds_by_unroll": {str(u): s for u, s in out.items()}, "unroll": best, "seconds": out[best]}


def bulk_warps(row_bytes: int, stages: int, chunk: int = 32, smem_cap: int = 200 * 1024) -> int:
    """Warps a block of the bulk-copy kernel: at most 4, each holding ``stages`` x ``chunk`` rows of
    ``row_bytes`` in shared memory, the block within ``smem_cap`` bytes (0: does not fit)."""
    return min(4, smem_cap // (stages * chunk * row_bytes))


def measure_bulk(n: int, nnz: int, row_bytes: int, n_sets: int = 1, seed: int = 0, repeats: int = 10,
                 stages=(2, 4, 8), chunks=(32,)) -> dict | None:
    """The fastest of the bulk-copy gather kernels (``BULK_SOURCE``: one ``cp.async.bulk`` a row,
    issued by one lane, completing on a per-stage mbarrier, ``stages`` chunks in flight a
    warp, ``chunks`` rows a chunk) for the inputs of :func:`measure` (same X, columns and checksum);
    None where no shape fits in shared memory."""
    import cupy as cp

    g = _Gathers(n, nnz, row_bytes, n_sets, seed, repeats)
    out, grid = {}, {}
    for S, C in itertools.product(stages, chunks):
        W = bulk_warps(row_bytes, S, C)
        if W < 1:
            continue
        smem = W * S * C * row_bytes
        kern = cp.RawKernel(BULK_SOURCE, "bulk_gather",
                            options=(f"-DBG_W={W}", f"-DBG_S={S}", f"-DBG_RB={row_bytes}", f"-DBG_C={C}"))
        kern.max_dynamic_shared_size_bytes = smem
        per_sm = max(1, min(2048 // (32 * W), prototype.SM_SMEM // (smem + 1024), 32))
        grid[S, C] = (g.sms * per_sm, W)
        out[S, C] = g.time(kern, g.sms * per_sm, 32 * W, f"bulk gather kernel S={S} C={C}", shared_mem=smem)
    if not out:
        return None
    best = min(out, key=out.get)
    return {"n": n, "nnz": nnz, "row_bytes": row_bytes, "n_sets": len(g.Xc), "stages": best[0], "chunk": best[1],
            "warps": grid[best][1], "blocks": grid[best][0],
            "seconds_by_shape": {f"S{k[0]}_C{k[1]}": v for k, v in out.items()}, "seconds": out[best]}


def empty_kernel_seconds(repeats: int = 10) -> float:
    """A one-block kernel that does nothing, under the same rule: the fixed cost of a launch."""
    import cupy as cp
    import torch

    from spcompile.autotune.measure import Timer
    from spcompile.runtime.cuda import _stream

    kern = cp.RawKernel('extern "C" __global__ void nothing(int* p) { if (p == 0) *p = 1; }', "nothing")
    buf = cp.zeros(1, dtype=cp.int32)
    return Timer("cuda", repeats=repeats).time(
        lambda _i: kern((1,), (32,), (buf,), stream=_stream(torch.cuda.current_stream().cuda_stream))).seconds


def rows_of(bench: dict, column: str, over: str) -> list[dict]:
    """(graph, K) rows of a bench JSON with what the report needs: sizes, floors and the times of
    ``column`` and of the baseline ``over`` (rows where either failed are left out)."""
    dtype = bench["settings"].get("dtype", "float32")
    e = ELEM_BYTES[dtype]
    out = []
    for r in bench["rows"]:
        cols = r.get("columns", {})
        a, b = cols.get(column, {}), cols.get(over, {})
        if a.get("status") != "ok" or b.get("status") != "ok":
            continue
        out.append({"graph": r["graph"], "nnz": int(r["nnz"]), "n": int(r["n"]), "K": int(r["K"]),
                    "row_bytes": int(r["K"]) * e, "floor_s": float(r["floor_s"]),
                    "l2_floor_s": r.get("l2_floor_s"), "seconds": float(a["seconds"]), "baseline_s": float(b["seconds"])})
    return out


def summarize(rows: list[dict]) -> dict:
    """Per K: geomean speed-up of the column and of kernels at the short bound (the larger of the
    HBM compulsory floor and the short gather time) and at the tables' larger floor."""
    def gm(v):
        return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None

    out = {}
    for K in sorted({r["K"] for r in rows}):
        rs = [r for r in rows if r["K"] == K]
        out[str(K)] = {"graphs": len(rs),
                       "x": gm([r["baseline_s"] / r["seconds"] for r in rs]),
                       "x_at_floor": gm([r["baseline_s"] / max(r["floor_s"], r["l2_floor_s"] or 0.0) for r in rs]),
                       "x_at_short_bound": gm([r["baseline_s"] / short_bound(r) for r in rs]),
                       "short_bound_frac": gm([short_bound(r) / r["seconds"] for r in rs])}
    return out


def short_bound(r: dict) -> float:
    return max(r["floor_s"], r["short_gather_s"])


def markdown(doc: dict) -> str:
    lines = [f"# {doc['name']}: gather-only kernels of the graphs' sizes ({doc['device']})", "",
             f"Generated by `{doc['command']}` ({doc['date']}), from the rows of `{doc['bench_name']}` "
             f"(column `{doc['column']}` over `{doc['over']}`).", "",
             "short gather = the fastest of gather-only kernels (one random row of K elements of the table's dtype "
             f"per nonzero from an X of the graph's n rows, U = {'/'.join(map(str, doc.get('unrolls', UNROLLS)))} rows in "
             "flight a lane, `benchmarks/short_gather.py`) "
             "timed by the Timer rule (CUDA-graph replay between events, median; calls rotate over as many copies of X as the table's input sets); l2 floor = the table's nnz*K*e at the "
             "L2 gather rate of long launches; short bound = the larger of the HBM compulsory floor and the short gather; "
             "x at ... = baseline time / that bound.  "
             f"A launch of an empty one-block kernel costs {doc['empty_kernel_s'] * 1e6:.2f} us by the same rule.", "",
             "| K | graphs | column x | x at the tables' larger floor | x at short bound | geomean short bound / column time |",
             "|---|---|---|---|---|---|"]
    for K, s in doc["summary"].items():
        lines.append(f"| {K} | {s['graphs']} | {s['x']:.2f} | {s['x_at_floor']:.2f} | {s['x_at_short_bound']:.2f} | "
                     f"{s['short_bound_frac']:.2f} |")
    bulk = bool(doc.get("bulk_stages"))
    if bulk:
        chunks = doc.get("bulk_chunks") or [32]
        lines += ["", "bulk gather = the same reads by one `cp.async.bulk` (TMA) copy a row into shared memory, "
                  f"S = {'/'.join(map(str, doc['bulk_stages']))} chunks of C = {'/'.join(map(str, chunks))} rows in "
                  "flight a warp, each chunk completing on an mbarrier, the rows folded from shared memory "
                  "(`BULK_SOURCE`); S, C = the fastest."]
    lines += ["", "| graph | nnz | n | K | HBM floor us | l2 floor us | short gather us | U | "
              + ("bulk gather us | S, C | " if bulk else "") + "column us | baseline us | "
              "x | x at floor | x at short bound |", "|---|---|---|---|---|---|---|---|" + ("---|---|" if bulk else "")
              + "---|---|---|---|---|"]
    for r in doc["rows"]:
        big = max(r["floor_s"], r["l2_floor_s"] or 0.0)
        b = (f"{r['bulk_gather_s'] * 1e6:.1f} | {r['bulk_stages']}, {r.get('bulk_chunk', 32)} | " if "bulk_gather_s" in r
             else "- | - | ") if bulk else ""
        lines.append(f"| {r['graph']} | {r['nnz']} | {r['n']} | {r['K']} | {r['floor_s'] * 1e6:.1f} | "
                     f"{(r['l2_floor_s'] or 0) * 1e6:.1f} | {r['short_gather_s'] * 1e6:.1f} | {r['unroll']} | " + b +
                     f"{r['seconds'] * 1e6:.1f} | {r['baseline_s'] * 1e6:.1f} | {r['baseline_s'] / r['seconds']:.2f} | "
                     f"{r['baseline_s'] / big:.2f} | {r['baseline_s'] / short_bound(r):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True, help="a bench.py JSON (its rows' graphs, K, dtype and times)")
    ap.add_argument("--column", default="default")
    ap.add_argument("--over", default="baseline_fp32", help="baseline column (default: cuSPARSE fp32; "
                    "tables of fp32 runs have only 'baseline')")
    ap.add_argument("--K", type=int, nargs="+", default=None)
    ap.add_argument("--unrolls", type=int, nargs="+", default=list(UNROLLS), help="nonzeros in flight a lane to try")
    ap.add_argument("--graphs", nargs="+", default=None, help="only these graphs of the JSON")
    ap.add_argument("--bulk-stages", type=int, nargs="*", default=None,
                    help="also time the bulk-copy (TMA) gather kernel with these stage counts (not a bound: reported beside)")
    ap.add_argument("--bulk-chunks", type=int, nargs="+", default=[32], help="rows a chunk of the bulk-copy kernel (at most 32)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    with open(a.bench) as fh:
        bench = json.load(fh)
    over = a.over if any(a.over in r.get("columns", {}) for r in bench["rows"]) else "baseline"
    rows = [r for r in rows_of(bench, a.column, over)
            if (a.K is None or r["K"] in a.K) and (a.graphs is None or r["graph"] in a.graphs)]
    if not rows:
        raise SystemExit(f"{a.bench}: no rows with both '{a.column}' and '{over}' measured")
    import torch

    done = {}
    for r in rows:
        key = (r["n"], r["nnz"], r["row_bytes"])
        if key not in done:
            done[key] = measure(*key, n_sets=int(bench["settings"].get("n_sets", 1)), unrolls=tuple(a.unrolls))
        m = done[key]
        r.update(short_gather_s=m["seconds"], unroll=m["unroll"], short_gather=m)
        if a.bulk_stages:
            if ("bulk",) + key not in done:
                done[("bulk",) + key] = measure_bulk(*key, n_sets=int(bench["settings"].get("n_sets", 1)),
                                                     stages=tuple(a.bulk_stages), chunks=tuple(a.bulk_chunks))
            b = done[("bulk",) + key]
            if b is not None:
                r.update(bulk_gather_s=b["seconds"], bulk_stages=b["stages"], bulk_chunk=b["chunk"], bulk_gather=b)
                print(f"{'':28s}        bulk gather {b['seconds'] * 1e6:7.1f} us (S={b['stages']}, C={b['chunk']}, "
                      f"{b['warps']} warps)", flush=True)
        print(f"{r['graph']:28s} K={r['K']:4d} short gather {m['seconds'] * 1e6:7.1f} us (U={m['unroll']})  "
              f"l2 floor {(r['l2_floor_s'] or 0) * 1e6:6.1f} us  column {r['seconds'] * 1e6:7.1f} us", flush=True)
    name = a.name or ("gather_only_" + bench["name"])   # not a bench.py result: not named like one
    doc = {"schema": "spcompile-short-gather/1", "name": name, "device": torch.cuda.get_device_name(),
           "command": "python benchmarks/short_gather.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "bench_name": bench["name"], "unrolls": list(a.unrolls),
           "bulk_stages": a.bulk_stages, "bulk_chunks": a.bulk_chunks if a.bulk_stages else None, "column": a.column, "over": over,
           "empty_kernel_s": empty_kernel_seconds(), "rows": rows, "summary": summarize(rows)}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, name + ".json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(a.out, name + ".md"), "w") as fh:
        fh.write(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
