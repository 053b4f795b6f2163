"""GPU SDDMM benchmark (sibling of spmm_gpu.py): cuSPARSE (torch.sparse.sampled_addmm) vs
csr.sddmm's best configuration vs the tuned best; kernel time and per-call latency; traffic floor
((m+1)*4 + nnz*8 + (m+n)*K*4 + nnz*4 bytes).

    python benchmarks/sddmm_gpu.py --out $OUT
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spmm_gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(op="sddmm", default_templates=("extern.cusparse", "csr.sddmm")))
