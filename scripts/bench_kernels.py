"""Time row_attention (Triton) against row_attention_reference (PyTorch); print a table.

Mirrors tests/test_kernels.py. On CUDA it times the compiled kernel with
triton.testing.do_bench; on CPU the kernel runs under the Triton interpreter (a
correctness tool: its times say nothing about GPU speed).

    python scripts/bench_kernels.py [--head-dim 64] [--prefix 300] [--heads 9 3]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from hf_selfspec.kernels import row_attention, row_attention_reference


def time_ms(fn, repeats: int) -> float:
    """Median wall time of fn() in ms (do_bench on CUDA)."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn)
    fn()  # warm-up (interpreter set-up)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=300, help="committed prefix length")
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    q_heads, kv_heads = args.heads
    depth = 8  # tree path slots per row, after the prefix
    num_slots = args.prefix + depth
    k_cache = torch.randn(kv_heads, num_slots, args.head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    scale = args.head_dim**-0.5

    print(
        f"device={device} dtype={args.dtype} d={args.head_dim} Hq={q_heads} Hkv={kv_heads} "
        f"prefix={args.prefix} path={depth}"
    )
    print(f"{'rows':>5} {'kernel ms':>10} {'reference ms':>13} {'max |diff|':>11}")
    for n in args.rows:
        q = torch.randn(n, q_heads, args.head_dim, device=device, dtype=dtype)
        prefix_len = torch.full((n,), args.prefix, dtype=torch.int32, device=device)
        anc = (args.prefix + torch.arange(depth, dtype=torch.int32, device=device)).repeat(n, 1)
        call = (q, k_cache, v_cache, prefix_len, anc, scale)
        diff = (row_attention(*call).float() - row_attention_reference(*call).float()).abs().max()
        kernel_ms = time_ms(lambda: row_attention(*call), args.repeats)  # noqa: B023
        ref_ms = time_ms(lambda: row_attention_reference(*call), args.repeats)  # noqa: B023
        print(f"{n:>5} {kernel_ms:>10.2f} {ref_ms:>13.2f} {diff.item():>11.2e}")


if __name__ == "__main__":
    main()
