"""What the prototype SpMM kernels of ``benchmarks/`` share (``length_buckets.py``,
``bulk_stream.py``): CUDA helpers for 16-byte words of float / half X and Y, and the harness that
times a prototype's shapes next to cuSPARSE and the ``default`` module of a committed benchmark
table (rebuilt through the product's ``build_from_config``), every result checked against the
float64 reference on NaN-poisoned outputs before the Timer rule times it (CUDA-graph replay
between events, median; three input sets).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

#: element access and packing of 16-byte words of X / Y: TB = 4 (float) or 2 (half, as raw 16-bit
#: words converted by cvt); ``elem<TB>(w, v)`` is element v of word w, ``pack<TB>(f)`` packs
#: 16 / TB floats
CUDA_ELEM_HELPERS = r"""
__device__ __forceinline__ float h2f(unsigned h) {
    float f; unsigned short s = (unsigned short)h; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s)); return f;
}
__device__ __forceinline__ unsigned f2h(float x) { unsigned short s; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s) : "f"(x)); return s; }
template <int TB> __device__ __forceinline__ float elem(const uint4& w, int v) {
    const unsigned q = v / (4 / TB) == 0 ? w.x : v / (4 / TB) == 1 ? w.y : v / (4 / TB) == 2 ? w.z : w.w;
    if (TB == 4) return __uint_as_float(q);
    return h2f((v & 1) ? (q >> 16) : (q & 0xffffu));
}
template <int TB> __device__ __forceinline__ uint4 pack(const float* f) {
    unsigned q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = TB == 4 ? __float_as_uint(f[k]) : (f2h(f[2 * k]) | (f2h(f[2 * k + 1]) << 16));
    return make_uint4(q[0], q[1], q[2], q[3]);
}
"""

#: one output row of a sum SpMM, for kernels that give a row to a group of G lanes (one 16-byte
#: word of the row a lane, CF beyond 32 words): nonzeros p0 .. p1 - 1, their ids and values read G
#: at a time (``cs`` / ``vs``: ids minus ``off`` index ``xs``), U rows of X (W16 words each) in
#: flight a lane, summed in nonzero order in fp32 (``row_acc``, into the lane's ``acc``) and
#: written once to row ``out`` of Y (``row_sum``).  Needs ``CUDA_ELEM_HELPERS``; ``xs`` / ``cs`` /
#: ``vs`` may point to global or shared memory, or be any type whose ``[]`` takes the word index
#: ``(size_t)id * W16 + word`` (``hot_cache.py``: negative ids read a shared copy).
CUDA_ROW_SUM = r"""
template <int TB, int G, int CF, int U, typename XP, typename IP, typename FP>
__device__ __forceinline__ void row_acc(float (&acc)[CF][16 / TB], XP xs, IP cs, FP vs, int p0, int p1, int off, int W16)
{
    constexpr int EPW = 16 / TB;
    const int lane = threadIdx.x % G;
    const int gl = (threadIdx.x % 32) / G * G;
    const unsigned gmask = G == 32 ? 0xffffffffu : (((1u << G) - 1u) << gl);
#pragma unroll
    for (int c = 0; c < CF; ++c)
#pragma unroll
        for (int v = 0; v < EPW; ++v) acc[c][v] = 0.0f;
    for (int base = p0; base < p1; base += G) {
        const int n = min(G, p1 - base);
        const int mc = lane < n ? cs[base + lane] - off : 0;
        const float mv = lane < n ? vs[base + lane] : 0.0f;
        for (int j0 = 0; j0 < n; j0 += U) {
            uint4 xv[U][CF];
            float a[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int cj = __shfl_sync(gmask, mc, gl + ((j0 + u) & (G - 1)));
                a[u] = __shfl_sync(gmask, mv, gl + ((j0 + u) & (G - 1)));
#pragma unroll
                for (int c = 0; c < CF; ++c) {
                    const int w = lane + c * G;
                    if (j0 + u < n && w < W16) xv[u][c] = xs[(size_t)cj * W16 + w];
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u < n) {
#pragma unroll
                    for (int c = 0; c < CF; ++c)
#pragma unroll
                        for (int v = 0; v < EPW; ++v) acc[c][v] += a[u] * elem<TB>(xv[u][c], v);
                }
        }
    }
}
template <int TB, int G, int CF, int U, typename XP, typename IP, typename FP>
__device__ __forceinline__ void row_sum(XP xs, IP cs, FP vs, int p0, int p1, int off, uint4* __restrict__ Y, int out,
                                        int W16)
{
    float acc[CF][16 / TB];
    row_acc<TB, G, CF, U>(acc, xs, cs, vs, p0, p1, off, W16);
    const int lane = threadIdx.x % G;
#pragma unroll
    for (int c = 0; c < CF; ++c) {
        const int w = lane + c * G;
        if (w < W16) Y[(size_t)out * W16 + w] = pack<TB>(acc[c]);
    }
}
"""

#: ``cp.async`` copies of 16 and 4 bytes from global to shared memory (sm_80 and later; the
#: caller commits and waits)
CUDA_CP_ASYNC = r"""
__device__ __forceinline__ void cp16(void* s, const void* g) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(g) : "memory");
}
__device__ __forceinline__ void cp4(void* s, const void* g) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(a), "l"(g) : "memory");
}
"""

#: Hopper bulk copies (sm_90): mbarriers in shared memory (32-bit shared addresses) that one
#: arrival and a transaction byte count complete, and a ``cp.async.bulk`` of ``bytes`` (a multiple
#: of 16, 16-byte aligned) from global to shared memory that completes on one of them
CUDA_BULK_HELPERS = r"""
__device__ __forceinline__ void mbar_init(unsigned bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
}
// after the initialisations, before any thread uses the barriers
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// the one arrival of the phase, announcing the bytes its copies bring
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// until the phase of this parity has completed
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned ok = 0;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
// the thread's reads of shared memory before the bulk copies it issues next
__device__ __forceinline__ void async_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
"""

ELEM_BYTES = {"float32": 4, "float16": 2}

#: shared memory of one SM (bytes, sm_90)
SM_SMEM = 228 * 1024


def resident_blocks(nw: int, smem: int, regs: int) -> int:
    """Blocks of ``nw`` warps one SM holds at once (threads, shared memory with 1 KB reserved a
    block, registers allocated 8 at a time a thread, at most 32 blocks): one wave of the grid."""
    per_thread = max(8, -(-int(regs) // 8) * 8)
    return max(1, min(2048 // (32 * nw), SM_SMEM // (smem + 1024), 65536 // (per_thread * 32 * nw), 32))


def default_configs(tables) -> dict:
    """(graph, K) -> the ``default`` column's configuration of the given bench.py JSONs (a later
    table's row replaces an earlier one's)."""
    cfgs = {}
    for t in tables:
        with open(t) as fh:
            for r in json.load(fh)["rows"]:
                c = r["columns"].get("default", {}).get("config")
                if c:
                    cfgs[(r["graph"], int(r["K"]))] = c
    return cfgs


def run(a, argv, script: str, arrays_of: Callable, shapes_of: Callable, launch_of: Callable) -> list[dict]:
    """Time a prototype on ``a.graphs`` at every ``a.K`` (``a``: the parsed ``--table``, ``--K``,
    ``--dtype``, ``--build-only``, ``--out``, ``--name`` of the scripts), writing the rows to
    ``a.out/a.name.json`` after every (graph, K).

    ``arrays_of(A)``: the prototype's host arrays (ValueError: the graph is left out, said why);
    ``shapes_of(K, eb)``: the shape dicts tried; ``launch_of(shape, A, arrays, device_arrays, K, eb)``:
    a dict with ``kern`` (a cupy RawKernel), ``grid``, ``block``, ``smem`` (bytes of dynamic shared
    memory), ``args(X, Y)`` (the kernel's arguments for one input set) and ``info`` (reported)."""
    import bench  # the product's workloads and columns: imported only to run (this module's CUDA
    #               helpers are used by scripts that need nothing else of it)
    from spcompile.core import numerics
    from spcompile.core.config import Config

    cfgs = default_configs(a.table)
    eb = ELEM_BYTES[a.dtype]
    timer = None
    if not a.build_only:
        import cupy as cp
        import torch

        from spcompile.autotune.measure import Timer
        from spcompile.runtime.cuda import _stream

        timer = Timer("cuda")
    out = []
    for name, path, _ in common.find_graphs(a.graphs):
        A = common.load_matrix(path)
        try:
            arr = arrays_of(A)
        except ValueError as e:
            print(f"{name}: {e}", flush=True)
            continue
        for K in a.K:
            cfg = cfgs.get((name, K))
            if a.build_only:
                if cfg:
                    bench.build_from_config(bench.make_op(A, "spmm", K, "sum", a.dtype), Config.from_dict(cfg))
                print(f"{name} K={K}: built", flush=True)
                continue
            w = bench.Workload(A, "spmm", "sum", K, a.dtype, "cuda")
            res = {"graph": name, "nnz": int(A.nnz), "m": int(A.shape[0]), "K": K, "dtype": a.dtype, "cells": []}
            res["baseline_us"] = timer.time(bench.col_baseline(w).call, n_sets=w.n_sets).seconds * 1e6
            if cfg:
                res["default"] = {"config": cfg, **bench.time_config(w, Config.from_dict(cfg), timer)}
            dev = {k: cp.asarray(v) for k, v in arr.items()}
            ins, outs = w.io()
            X = [cp.asarray(x[0]) for x in ins]
            Y = [cp.asarray(y) for y in outs]
            for s in shapes_of(K, eb):
                ln = launch_of(s, A, arr, dev, K, eb)
                if ln is None:
                    continue
                kern = ln["kern"]
                if ln["smem"] > 48 * 1024:
                    kern.max_dynamic_shared_size_bytes = ln["smem"]
                args = [ln["args"](X[i], Y[i]) for i in range(len(X))]

                def call(i, kern=kern, args=args, ln=ln):
                    kern(ln["grid"], ln["block"], args[i], shared_mem=ln["smem"],
                         stream=_stream(torch.cuda.current_stream().cuda_stream))
                    return outs[i]

                err = w.check(call)
                tol = numerics.result_tolerance("fp32", a.dtype)
                cell = {**s, **ln.get("info", {}), "regs": int(kern.num_regs), "rel_err": err}
                cell["us"] = timer.time(call, n_sets=w.n_sets).seconds * 1e6 if err <= tol else None
                res["cells"].append(cell)
            best = min((c for c in res["cells"] if c["us"]), key=lambda c: c["us"], default=None)
            d = res.get("default", {}).get("us")
            print(f"{name:24s} K={K:3d} cuSPARSE {res['baseline_us']:7.1f} default {d or float('nan'):7.1f} "
                  f"prototype {best['us'] if best else float('nan'):7.1f} {best}", flush=True)
            for c in res["cells"]:
                shape = " ".join(f"{k}={v}" for k, v in c.items() if k not in ("us", "rel_err"))
                print(f"    {c['us'] or float('nan'):7.1f} {shape} err={c['rel_err']:.2g}", flush=True)
            out.append(res)
            w.release()
            common.write_rows(a.out, a.name, script, argv, out)
    return out


def arg_parser(doc: str, default_name: str):
    """The scripts' common command line: graphs, ``--table`` (repeatable), ``--K``, ``--dtype``,
    ``--build-only``, ``--out``, ``--name``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--table", action="append", required=True, help="bench.py JSON whose 'default' module is timed beside")
    ap.add_argument("--K", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtype", default="float32", choices=sorted(ELEM_BYTES))
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default=default_name)
    return ap
