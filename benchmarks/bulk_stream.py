"""Rows streamed through a pipeline of Hopper bulk copies: a prototype SpMM for graphs of short
rows, timed next to ``build()``.

The fp32 modules furthest from their floor (meshes, batches of molecules) wait on each short
row's chain of dependent loads (row pointer, column ids, X rows).  ``csr.crc_cwm``'s staged stream
(``flat=2``) copies a chunk's X rows to shared memory and waits for all of them before the next
chunk's copies start.  This kernel keeps ``S`` chunks in flight without registers or waits on the
sparse structure in between:

* the nonzeros are cut into equal runs, one a *stream* of G lanes (a row of X is G 16-byte words
  or CF per lane beyond 32 words; a warp holds 32 / G streams; one wave of blocks).  A stream
  owns the rows that start in its run (``stream_rows``, computed on the host), so it may read
  past its run to finish its last row, and no row is split;
* each chunk of C nonzeros (4, 8 or G): the lanes read their column ids and values (values to
  shared memory), lane 0 announces the chunk's bytes on the stage's mbarrier, and each lane
  issues one ``cp.async.bulk`` a nonzero that moves the whole row of X into the stage (Hopper's
  copy engine; one instruction a row, no register holds it);
* the stream waits on the oldest stage's mbarrier, sums its rows into the current output row in
  nonzero order (row ends from a window of G row pointers held one a lane), writes each row once
  as it ends (empty rows as zeros), and reissues the stage ``S`` chunks ahead.

Sum only, X / Y of 4- or 2-byte elements with K x element bytes a multiple of 16 (each row of X
one bulk copy), sm_90 only.  For every graph and K it reports cuSPARSE, the ``default`` module of
a committed table rebuilt through ``build_from_config`` and this kernel's shapes (``S``, ``C``),
each checked against the float64 reference on NaN-poisoned outputs before it is timed
(``prototype.run``).

    python benchmarks/bulk_stream.py GRAPH ... --table docs/benchmarks/h200_spmm_fp32_default_big_v3.json
        [--K 64 128] [--dtype float32|float16] [--out DIR] [--name NAME] [--build-only]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prototype  # noqa: E402
from prototype import resident_blocks  # noqa: E402

#: shared memory a block may use (bytes)
SMEM_CAP = 200 * 1024

SOURCE = prototype.CUDA_ELEM_HELPERS + prototype.CUDA_BULK_HELPERS + r"""
// BS_TB: bytes of an element of X / Y; BS_K: columns; BS_S: stages; BS_C: nonzeros a chunk (at most
// 2 x the stream's lanes); BS_NW: warps a block
extern "C" __global__ void __launch_bounds__(BS_NW * 32) bulk_stream(
    const int* __restrict__ indptr, const int* __restrict__ indices, const float* __restrict__ data,
    const int* __restrict__ srow, const unsigned char* __restrict__ X, uint4* __restrict__ Y, int m)
{
    constexpr int TB = BS_TB, K = BS_K, RB = K * TB, W16 = RB / 16, G = W16 < 32 ? W16 : 32;
    constexpr int CF = (W16 + G - 1) / G, EPW = 16 / TB, S = BS_S, C = BS_C, NW = BS_NW, SPW = 32 / G;
    static_assert(C <= 2 * G, "a lane copies at most two rows a chunk");
    static_assert(RB % 16 == 0, "a row of X is whole 16-byte words");
    extern __shared__ __align__(128) unsigned char smem[];
    const int lane32 = threadIdx.x % 32, l = lane32 % G, gl = lane32 / G * G;
    const int st = (threadIdx.x / 32) * SPW + lane32 / G;          // stream in block
    const unsigned gmask = G == 32 ? 0xffffffffu : (((1u << G) - 1u) << gl);
    // layout: mbarriers [NW * SPW][S] (padded to 128 bytes), stages [NW * SPW][S][C] rows, values [NW * SPW][S][C]
    constexpr int BAR_BYTES = ((NW * SPW * S * 8 + 127) / 128) * 128;
    unsigned char* stage = smem + BAR_BYTES + (size_t)st * S * C * RB;
    float* sval = reinterpret_cast<float*>(smem + BAR_BYTES + (size_t)NW * SPW * S * C * RB) + st * S * C;
    const unsigned bar0 = (unsigned)__cvta_generic_to_shared(smem) + 8u * st * S;
    const unsigned stage0 = (unsigned)__cvta_generic_to_shared(stage);
    const long long sid = (long long)blockIdx.x * NW * SPW + st;
    const int r0 = srow[sid], r1 = srow[sid + 1];
    if (r0 >= r1) return;                                           // the stream owns no row
    if (l < S) mbar_init(bar0 + 8 * l);
    mbar_init_fence();
    __syncwarp(gmask);
    const int P0 = indptr[r0], P1 = indptr[r1];
    const int nch = (P1 - P0 + C - 1) / C;
    auto issue = [&](int k, int s) {
        const int base = P0 + k * C, n = min(C, P1 - base);
        if (l == 0) mbar_expect(bar0 + 8 * s, n * RB);
        __syncwarp(gmask);
#pragma unroll
        for (int q = 0; q < (C + G - 1) / G; ++q) {
            const int j = q * G + l;
            if (j < n) {
                const int col = __ldg(indices + base + j);
                sval[s * C + j] = __ldg(data + base + j);
                bulk_copy(stage0 + (unsigned)((s * C + j) * RB), X + (long long)col * RB, RB, bar0 + 8 * s);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < S; ++s)
        if (s < nch) issue(s, s);
    float acc[CF][EPW];
#pragma unroll
    for (int c = 0; c < CF; ++c)
#pragma unroll
        for (int v = 0; v < EPW; ++v) acc[c][v] = 0.0f;
    // row ends: lane l holds indptr[rb + 1 + l]; the current row r ends at rend
    int r = r0, rb = r0;
    int re = rb + 1 + l <= m ? __ldg(indptr + rb + 1 + l) : P1;
    int rend = __shfl_sync(gmask, re, gl);
    auto flush = [&]() {                                            // write row r, go to the next
#pragma unroll
        for (int c = 0; c < CF; ++c) {
            const int w = l + c * G;
            if (w < W16) Y[(size_t)r * W16 + w] = pack<TB>(acc[c]);
#pragma unroll
            for (int v = 0; v < EPW; ++v) acc[c][v] = 0.0f;
        }
        ++r;
        if (r < r1) {
            if (r - rb >= G) {
                rb = r;
                re = rb + 1 + l <= m ? __ldg(indptr + rb + 1 + l) : P1;
            }
            rend = __shfl_sync(gmask, re, gl + (r - rb));
        }
    };
    unsigned phases = 0u;
    int s = 0;
    for (int k = 0; k < nch; ++k) {
        mbar_wait(bar0 + 8 * s, (phases >> s) & 1u);
        phases ^= 1u << s;
        const int base = P0 + k * C, n = min(C, P1 - base);
        for (int j = 0; j < n; ++j) {
            while (base + j >= rend) flush();                         // rows that end before this nonzero
            const float a = sval[s * C + j];
            const uint4* row = reinterpret_cast<const uint4*>(stage + (size_t)(s * C + j) * RB);
#pragma unroll
            for (int c = 0; c < CF; ++c) {
                const int w = l + c * G;
                if (w < W16) {
                    const uint4 x = row[w];
#pragma unroll
                    for (int v = 0; v < EPW; ++v) acc[c][v] += a * elem<TB>(x, v);
                }
            }
        }
        __syncwarp(gmask);                                            // every lane is done with stage s
        async_proxy_fence();
        if (k + S < nch) issue(k + S, s);
        s = (s + 1 == S) ? 0 : s + 1;
    }
    while (r < r1) flush();                                           // the last row and empty rows after it
}
"""


def lanes(K: int, eb: int) -> int:
    """Lanes a stream: one a 16-byte word of a row of X, at most 32."""
    return min(32, K * eb // 16)


def stream_rows(indptr: np.ndarray, streams: int) -> np.ndarray:
    """``streams + 1`` row bounds: stream k owns rows ``srow[k]:srow[k + 1]``, those whose first
    nonzero lies in its run ``[k E, (k + 1) E)`` of ``E = ceil(nnz / streams)`` nonzeros; the stream
    whose run holds the last nonzero owns the empty rows after it too, the first stream the empty
    rows before the first nonzero (all rows when there is none)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    m, nnz = indptr.size - 1, int(indptr[-1])
    E = max(1, -(-nnz // max(1, int(streams))))
    e = np.arange(streams + 1, dtype=np.int64) * E
    srow = np.where(e < nnz, np.searchsorted(indptr, e, side="left"), m)
    srow[0] = 0
    return srow.astype(np.int32)


def block_shape(K: int, eb: int, S: int, C: int) -> tuple[int, int] | None:
    """(warps a block, bytes of dynamic shared memory) of the largest block of at most 4 warps
    whose stages (``S`` chunks of ``C`` rows a stream), values and mbarriers fit in ``SMEM_CAP``;
    None where one warp does not fit."""
    spw = 32 // lanes(K, eb)
    for nw in (4, 3, 2, 1):
        bars = -(-nw * spw * S * 8 // 128) * 128
        smem = bars + nw * spw * S * C * (K * eb + 4)
        if smem <= SMEM_CAP:
            return nw, smem
    return None


def shapes(K: int, eb: int) -> list[dict]:
    """(S, C) shapes tried: 1 / 2 / 4 / 8 stages of 2 / 4 / 8 nonzeros or one a lane (C = the
    stream's lanes), where K x element bytes is a multiple of 16 (one bulk copy a row) and a block
    fits."""
    if (K * eb) % 16:
        return []
    G = lanes(K, eb)
    return [{"S": S, "C": C} for S in (1, 2, 4, 8) for C in sorted({min(2, G), min(4, G), min(8, G), G})
            if block_shape(K, eb, S, C)]


def csr_arrays(A) -> dict:
    """The kernel's CSR arrays (column ids sorted within rows, fp32 values)."""
    A = A.tocsr()
    A.sort_indices()
    return {"indptr": A.indptr.astype(np.int32), "indices": A.indices.astype(np.int32),
            "data": A.data.astype(np.float32)}


def main(argv=None) -> int:
    a = prototype.arg_parser(__doc__, "bulk_stream").parse_args(argv)

    def launch(s, A, arr, dev, K, eb):
        import cupy as cp
        import torch

        nw, smem = block_shape(K, eb, s["S"], s["C"])
        opts = (f"-DBS_TB={eb}", f"-DBS_K={K}", f"-DBS_S={s['S']}", f"-DBS_C={s['C']}", f"-DBS_NW={nw}")
        kern = cp.RawKernel(SOURCE, "bulk_stream", options=opts)
        sms = int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
        blocks = sms * resident_blocks(nw, smem, int(kern.num_regs))
        streams = blocks * nw * (32 // lanes(K, eb))
        srow = cp.asarray(stream_rows(arr["indptr"], streams))
        return {"kern": kern, "grid": (blocks,), "block": (32 * nw,),
                "smem": smem, "info": {"warps": nw, "blocks": blocks, "streams": streams},
                "args": lambda X, Y: (dev["indptr"], dev["indices"], dev["data"], srow, X, Y, np.int32(A.shape[0]))}

    prototype.run(a, argv, "bulk_stream.py", csr_arrays, shapes, launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
