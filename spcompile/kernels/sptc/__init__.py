"""Sparse tensor-core template (mma.sp on V:N:M): sptc.vnm."""
