"""Thin device layer: CPU (TVM llvm modules) and CUDA (kernel loading, launch, DLPack)."""
from .target import resolve_target, cuda_available, TargetUnavailableError

__all__ = ["resolve_target", "cuda_available", "TargetUnavailableError"]
