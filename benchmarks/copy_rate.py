"""The GPU's device-to-device copy rate, the bandwidth of ``bench.py``'s compulsory-traffic floor
(``--bandwidth``): a 2 GiB fp32 tensor copied into another, (read + write bytes) / time, CUDA
events around each copy, median of 20 after 3 warm-up copies.

    python benchmarks/copy_rate.py          # on a GPU machine: prints B/s
"""
from __future__ import annotations

import statistics


def copy_rate(n: int = 1 << 29, repeats: int = 20) -> float:
    """(read + write bytes) / median time of copying ``n`` fp32 values on the current GPU."""
    import torch

    x = torch.empty(n, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * 4 * n / statistics.median(times)


if __name__ == "__main__":
    print(f"{copy_rate():.4e}")
