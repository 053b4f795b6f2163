"""TVM TensorIR schedules (CPU llvm and CUDA)."""
