"""CSR CUDA templates: csr.crc_cwm (GE-SpMM) and csr.sddmm."""
