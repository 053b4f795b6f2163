"""Tensor-core templates on SGT blocks: tc.wmma_sgt and tc.wmma_sgt_sddmm."""
