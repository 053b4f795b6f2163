"""Every CUDA template compiles with nvcc for sm_90 and sm_80 (runs in CI on the CPU machine).

A representative set of instances per template (every reduction x every coarsening factor, every
vector width, every row-group width; for SDDMM every group x vector width x K chunks, and its
nonzero-parallel FLAT = 1 variant for every group, float and 16-bit) is rendered into ONE
translation unit per template and arch, so a broken instantiation fails the test."""
import os
import re
import subprocess

import pytest

from spcompile.runtime import cuda as rt
from spcompile.kernels import get_template

pytestmark = pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")


def _spmm_instances():
    t = get_template("csr.crc_cwm")
    inst = set()
    for r in ("sum", "max", "min", "mean"):
        for cf in (1, 2, 4, 8):
            inst.update(t.instances(r, cf, 4, 32))
        for vec in (1, 2):
            inst.update(t.instances(r, 2, vec, 32))
        for g in (4, 8, 16):
            inst.update(t.instances(r, 1, 4, g))
        inst.update(t.instances(r, 1, 4, 32, 2, "float32", 1))        # flat streams of rows
        for mb in (4, 6, 8):                                            # launch bounds, min blocks
            inst.update(t.instances(r, 1, 4, 32, 1 if mb == 8 else 4, "float32", 0, mb))
    inst.update(t.instances("sum", 2, 8, 16, 4, "float16", 1))
    inst.update(t.instances("mean", 1, 8, 32, 1, "bfloat16", 0, 8))
    # the split-row combine capped at 16 values a lane: 16-bit and fp32, flat, with launch bounds
    inst.update(t.instances("sum", 1, 8, 8, 8, "float16", 0, 1, 16))
    inst.update(t.instances("max", 2, 8, 16, 4, "bfloat16", 1, 1, 16))
    inst.update(t.instances("mean", 1, 8, 8, 8, "float16", 0, 4, 16))
    inst.update(t.instances("min", 2, 4, 32, 8, "float32", 0, 1, 16))
    # 16 X rows in flight a lane: chunks wider than the group (4 / 8 lanes), flat, launch bounds
    inst.update(t.instances("sum", 1, 8, 8, 16, "float16"))
    inst.update(t.instances("max", 2, 8, 4, 16, "bfloat16", 1))
    inst.update(t.instances("mean", 1, 8, 32, 16, "float16", 0, 4))
    inst.update(t.instances("min", 1, 4, 16, 16, "float32"))
    # the staged stream (flat=2, cp.async on sm_80+): every reduction, chunks of 4 / 8 / 32,
    # 16- to 2-byte copies (16-bit vec 1: a plain load and store), launch bounds
    for r in ("sum", "max", "min", "mean"):
        inst.update(t.instances(r, 1, 4, 16, 8, "float32", 2, 4))
    inst.update(t.instances("sum", 2, 4, 32, 2, "float32", 2))
    inst.update(t.instances("mean", 1, 8, 8, 32, "float16", 2, 4))
    inst.update(t.instances("max", 1, 2, 16, 8, "bfloat16", 2))
    # staged segments (flat=3): every reduction at 16 bits with launch bounds (quick selection's
    # shape), fp32, chunks of 4 / 32, 2-byte copies
    for r in ("sum", "max", "min", "mean"):
        inst.update(t.instances(r, 1, 8, 8, 8, "float16", 3, 4))
    inst.update(t.instances("sum", 2, 4, 16, 4, "float32", 3))
    inst.update(t.instances("mean", 1, 1, 32, 32, "bfloat16", 3, 8))
    # ELL rows (flat=4): every reduction with quick selection's launch bounds, one and two slices a
    # lane, fewer entries than lanes, 16 entries, 2-byte loads
    for r in ("sum", "max", "min", "mean"):
        inst.update(t.instances(r, 1, 8, 8, 4, "float16", 4, 4))
    inst.update(t.instances("sum", 2, 4, 8, 4, "float32", 4, 4))
    inst.update(t.instances("max", 2, 1, 32, 8, "float32", 4))
    inst.update(t.instances("mean", 1, 1, 4, 16, "bfloat16", 4))
    return t, sorted(inst)


def _sddmm_instances():
    t = get_template("csr.sddmm")
    inst = set()
    for g in (4, 8, 16, 32):
        for vec in (1, 2, 4):
            for xc in (1, 2, 4, 8):
                inst.update(t.instances(g, vec, xc))
        # FLAT = 1 (segments across rows, the X row per nonzero): float and both 16-bit types
        inst.update(t.instances(g, 4, 2, "float32", 1))
        inst.update(t.instances(g, 8, 1, "float16", 1))
        inst.update(t.instances(g, 2, 4, "bfloat16", 1))
        # several entries in flight a group (unroll 2 / 4): one-row and flat segments, one and
        # several tiles, every element type
        inst.update(t.instances(g, 4, 1, "float32", 0, 4))
        inst.update(t.instances(g, 4, 4, "float32", 1, 2))
        inst.update(t.instances(g, 8, 2, "float16", 0, 2))
        inst.update(t.instances(g, 8, 1, "bfloat16", 1, 4))
    return t, sorted(inst)


def _window_instances():
    """csr.window: every reduction x element type (fp32 / fp16 / bf16) at several vector widths,
    every rows-per-warp with one and two staging buffers (each with its VEC = 1 fallback)."""
    t = get_template("csr.window")
    inst = set()
    vecs = {"float32": (4, 2), "float16": (8, 4), "bfloat16": (8, 2)}
    rpw_nbuf = [(r, b) for r in (1, 2, 4, 8) for b in (1, 2)]
    for i, (r, dt) in enumerate((r, dt) for r in ("sum", "max", "min", "mean") for dt in vecs):
        rpw, nbuf = rpw_nbuf[i % len(rpw_nbuf)]
        inst.update(t.instances(r, vecs[dt][i % 2], rpw, nbuf, dt))
    assert {(a[3], a[4]) for _, a in inst} >= set(rpw_nbuf)
    return t, sorted(inst)


_INSTANCES = {"spmm": _spmm_instances, "sddmm": _sddmm_instances, "window": _window_instances}


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("which", sorted(_INSTANCES))
def test_templates_compile(tmp_path, arch, which):
    t, inst = _INSTANCES[which]()
    src = tmp_path / f"{which}.cu"
    src.write_text(t.render(inst))
    out = tmp_path / f"{which}.cubin"
    r = subprocess.run([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    data = out.read_bytes()
    for name, _ in inst:  # every wrapper was emitted with its C name
        assert name.encode() in data, name


def test_compile_cache_and_build_without_gpu(tmp_path, monkeypatch):
    """build() compiles (once: the second build hits the on-disk cache) without needing a GPU."""
    import numpy as np
    import scipy.sparse as sp

    from spcompile.compile import make_op
    from spcompile.core.ir import SparseModule

    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    A = sp.random(50, 40, density=0.1, format="csr", random_state=0, dtype=np.float32)
    mod = SparseModule.from_op(make_op(A, "spmm", 33, "max"))
    t = get_template("csr.crc_cwm")
    k1 = t.build(mod, t.default_params(mod))
    path = k1.files["kernel.fatbin"]
    assert os.path.isfile(path) and path.startswith(str(tmp_path / "cache"))
    mtime = os.path.getmtime(path)
    k2 = t.build(mod, t.default_params(mod))
    assert k2.files["kernel.fatbin"] == path and os.path.getmtime(path) == mtime
    # the partition covers every nonzero exactly once, long rows split into slices
    A2 = sp.csr_matrix(A)
    lens = np.diff(A2.indptr)
    from spcompile.kernels.csr.packer import spmm_partition

    part = spmm_partition(np.array([0, 0, 10000, 10003]), np.array([2, 0, 1]), 256)
    assert part["seg_ptr"][0] == 0 and part["seg_ptr"][-1] == 10003
    assert np.all(np.diff(part["seg_ptr"]) <= 256) and (part["seg_slot"] >= 0).sum() == 40
    assert list(part["grp_out"]) == [0] and list(part["grp_len"]) == [10000]
    assert lens.sum() == A.nnz


def test_window_builds_for_pre_ampere_or_refuses_it(tmp_path, monkeypatch):
    """csr.window stages with cp.async (sm_80 and newer).  On an older GPU (sm_75) build() either
    compiles it or refuses it up front with the arch it needs (a ValueError, as templates with a
    ``min_arch`` do); never an nvcc failure.  csr.crc_cwm compiles for sm_75 here (the toolchain
    targets it)."""
    import numpy as np
    import scipy.sparse as sp

    from spcompile.compile import make_op
    from spcompile.core.ir import SparseModule

    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 75)
    A = sp.random(50, 40, density=0.1, format="csr", random_state=0, dtype=np.float32)
    mod = SparseModule.from_op(make_op(A, "spmm", 32, "sum"))
    c = get_template("csr.crc_cwm")
    assert os.path.isfile(c.build(mod, c.default_params(mod)).files["kernel.fatbin"])
    t = get_template("csr.window")
    try:
        k = t.build(mod, t.default_params(mod))
    except ValueError as e:
        assert t.min_arch > 75 and f"sm_{t.min_arch}" in str(e)
    else:
        assert k.meta["arch"] == 75 and os.path.isfile(k.files["kernel.fatbin"])


def test_render_is_one_source():
    """Variants differ only by their instantiation line (no copy-pasted bodies)."""
    t = get_template("csr.crc_cwm")
    a = t.render(t.instances("sum", 1, 1, 32))
    b = t.render(t.instances("max", 8, 4, 16))
    assert a.split("SPC_SPMM_INSTANCE(spmm")[0] == b.split("SPC_SPMM_INSTANCE(spmm")[0]


_PTX_BITS = {"ptr": 64, "int32": 32, "uint32": 32, "int64": 64, "uint64": 64, "float32": 32, "float64": 64}


def _ptx_entries(ptx: str) -> dict[str, list[int]]:
    """Parameter sizes in bits of every ``.entry`` of a PTX module, in order."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, flags=re.S):
        out[m.group(1)] = [int(b) for b in re.findall(r"\.param\s+\.[bsuf](\d+)", m.group(2))]
    return out


@pytest.mark.parametrize("name,instances", [
    ("csr.crc_cwm", [("sum", 2, 4, 32, 2, "float32"), ("mean", 1, 8, 8, 4, "bfloat16")]),
    ("csr.sddmm", [(8, 4, 2, "float32"), (16, 8, 1, "float16"), (32, 1, 4, "bfloat16", 1),   # last: FLAT = 1
                   (8, 4, 1, "float32", 0, 4), (16, 8, 1, "float16", 1, 2)]),                 # unroll 4 / 2
    ("sptc.vnm", [("fp16", 4, "float32")]),
    ("csr.window", [("sum", 4, 2, 2, "float32"), ("max", 8, 8, 1, "bfloat16"), ("mean", 2, 1, 2, "float16")]),
    ("aspt.tiled", [(4, 2, 1, "sum", "tasks"), (2, 1, 1, "max", "panel", 2)]),
    ("tc.wmma_sgt_sddmm", [("tf32", 8, 2, 4, 0), ("bf16", 16, 1, 8, 1)]),
    ("tc.wmma_sgt", [("tf32", 16, 2, 0, 4), ("fp16", 16, 1, 1, 8, 1),                       # impl "wmma"
                     ("tf32", 8, 1, 1, 4, 0, "mma", 2, 2), ("bf16", 16, 1, 1, 8, 1, "mma", 2, 1)]),
])
def test_parsed_signatures_match_the_compiled_entries(tmp_path, name, instances):
    """The parameter list LaunchPlan reads from the rendered source has the order and sizes of
    the entry points nvcc compiles (PTX ``.param`` lists): a misread signature would make every
    launch pass its arguments in the wrong slots."""
    t = get_template(name)
    inst = sorted({i for args in instances for i in t.instances(*args)})
    src = tmp_path / "k.cu"
    src.write_text(t.render(inst))
    out = tmp_path / "k.ptx"
    r = subprocess.run([rt.nvcc_path(), "-ptx", "-std=c++17", "-arch=sm_90", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    entries = _ptx_entries(out.read_text())
    source = t.render(inst)
    checked = 0
    for entry, bits in entries.items():
        sig = rt.kernel_signature(source, entry)
        assert [_PTX_BITS[ty] for _, ty in sig.params] == bits, entry
        checked += 1
    names = {n for n, _ in inst}
    assert checked >= len(names) and all(any(e.startswith(n) for e in entries) for n in names)
    assert set(getattr(t, "entry_points", ())) <= set(entries)      # helper kernels launched by name


def _gat_instances():
    """The (TN, VEC, G, CH) of the GAT kernels (spcompile/nn/gat.cu) for every element type: the
    configurations the launcher picks for C = 1, 5, 16, 32, 33, 64, 600 and the unaligned
    fallback (VEC = 1) of C = 600 (16 chunks per lane, two column tiles)."""
    torch = pytest.importorskip("torch")
    from spcompile.nn import gat

    inst = set()
    for dtype, (tn, _) in gat.DTYPES.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        for C in (1, 5, 16, 32, 33, 64, 600):
            inst.add((tn, *gat.config(C, itemsize)))
        inst.add((tn, *gat.config(600, itemsize, 1)))
    return gat, sorted(inst)


@pytest.mark.parametrize("arch", [90, 80])
def test_gat_kernels_compile(tmp_path, arch):
    gat, inst = _gat_instances()
    assert {i[0] for i in inst} == {0, 1, 2}
    src = tmp_path / "gat.cu"
    src.write_text(gat.render(inst))
    out = tmp_path / "gat.cubin"
    r = subprocess.run([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "warning" not in r.stderr, r.stderr[-4000:]
    data = out.read_bytes()
    names = ["gat_row_sum"] + [f"gat_{k}_merge_{s}" for k in ("fwd", "sum") for s in ("f32", "f16", "bf16")]
    names += [f"gat_{k}_{gat.instance_suffix(*i)}" for i in inst for k in ("fwd", "dot", "bwd_col")]
    for name in names:
        assert name.encode() in data, name


def test_gat_parsed_signatures_match_the_compiled_entries(tmp_path):
    """The parameter lists LaunchPlan reads from the rendered GAT source have the order and sizes
    of the PTX entries nvcc compiles."""
    gat, inst = _gat_instances()
    inst = [i for i in inst if i[1:] in ((4, 8, 1), (8, 32, 2), (1, 1, 1))]
    source = gat.render(inst)
    src = tmp_path / "gat.cu"
    src.write_text(source)
    out = tmp_path / "gat.ptx"
    r = subprocess.run([rt.nvcc_path(), "-ptx", "-std=c++17", "-arch=sm_90", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    entries = _ptx_entries(out.read_text())
    assert len(entries) == 1 + 2 * len({i[0] for i in inst}) + 3 * len(inst)
    for entry, bits in entries.items():
        sig = rt.kernel_signature(source, entry)
        assert [_PTX_BITS[ty] for _, ty in sig.params] == bits, entry


def test_gat_compiles_through_the_runtime_cache(tmp_path, monkeypatch):
    """compile_cuda on one rendered instance (what the first CUDA call does): cached on disk."""
    gat, _ = _gat_instances()
    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    src = gat.render([(0, 4, 8, 1)])
    path = rt.compile_cuda(src, arch=90, name="gat_f32_v4_g8_c1")
    assert os.path.isfile(path) and rt.compile_cuda(src, arch=90, name="gat_f32_v4_g8_c1") == path


def _ptxas_registers(tmp_path, t, inst, arch: int) -> dict:
    """Registers a thread of each entry of ``inst`` (rendered into one unit) on ``sm_<arch>`` (ptxas -v)."""
    src = tmp_path / "regs.cu"
    src.write_text(t.render(inst))
    r = subprocess.run([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-Xptxas", "-v",
                        "-o", str(tmp_path / "regs.cubin"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    regs = {}
    for part in (r.stdout + r.stderr).split("Compiling entry function '")[1:]:
        regs[part.split("'", 1)[0]] = int(re.search(r"Used (\d+) registers", part).group(1))
    return regs


def test_capped_combine_takes_fewer_registers(tmp_path):
    """csr.crc_cwm ``combine_vals`` 16: the split-row combine of a 16-bit kernel with VEC 8 and
    unroll 8 holds 16 fp32 values a lane instead of 64, and the kernel takes at most 96 registers a
    thread on sm_90 instead of more than 128 (16 -> 20 or more warps an SM); a parameter set
    without it keeps its kernel and name."""
    t = get_template("csr.crc_cwm")
    inst = [t.instances("sum", 1, 8, 8, 8, dt, 0, 1, cq)[0] for dt in ("float16", "bfloat16") for cq in (0, 16)]
    assert [n for n, _ in inst] == ["spmm_crc_cwm_f16_r0_cf1_v8_g8_u8", "spmm_crc_cwm_f16_r0_cf1_v8_g8_u8_cq16",
                                    "spmm_crc_cwm_bf16_r0_cf1_v8_g8_u8", "spmm_crc_cwm_bf16_r0_cf1_v8_g8_u8_cq16"]
    regs = _ptxas_registers(tmp_path, t, inst, 90)
    for n, _ in inst:
        assert (regs[n] <= 96) == n.endswith("_cq16") and (n.endswith("_cq16") or regs[n] > 128), regs


@pytest.mark.parametrize("arch", [90, 80])
def test_spmm_min_blocks_caps_registers(tmp_path, arch):
    """csr.crc_cwm ``min_blocks`` MB reaches ptxas as launch bounds: every instance of MB = 4 / 6 /
    8 uses at most 65536 / (256 MB) registers a thread (64 / 40 / 32 after the allocation
    granularity), the same kernel without them more than 32 (the cap is what changes it)."""
    t = get_template("csr.crc_cwm")
    inst = []
    for mb in (1, 4, 6, 8):
        inst += t.instances("sum", 1, 4, 32, 4, "float32", 0, mb)
    regs = _ptxas_registers(tmp_path, t, inst, arch)
    assert set(regs) == {n for n, _ in inst}, regs
    for n, _ in inst:
        mb = int(n.rsplit("_mb", 1)[1]) if "_mb" in n else 1
        cap = {1: 255, 4: 64, 6: 40, 8: 32}[mb]
        assert regs[n] <= cap, (n, regs[n])
    assert regs["spmm_crc_cwm_f32_r0_cf1_v4_g32_u4"] > 32
