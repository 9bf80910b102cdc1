"""Time row_attention (Triton) against row_attention_reference (PyTorch); print a table.
With --cpu-rows: time the C++ row products (kernels/cpu_rows.cpp) of one step instead.

Mirrors tests/test_kernels.py. On CUDA it times the compiled kernel with
triton.testing.do_bench; on CPU the kernel runs under the Triton interpreter (a
correctness tool: its times say nothing about GPU speed).

    python scripts/bench_kernels.py [--head-dim 64] [--prefix 300] [--heads 9 3]
    python scripts/bench_kernels.py --cpu-rows [--threads 1 2] [--rows 1 4 8] [--dtypes float32 bfloat16]
        [--baseline old_cpu_rows.cpp] [--pool]

--cpu-rows: every product of one decode step of a SmolLM2-135M-shaped model (hidden 576,
intermediate 1536, 30 layers, vocabulary 49152; 9 heads of 64 over 3 KV heads) through
`rows_linear`, per thread count, rows and weight dtype, timed in interleaved rounds (one
process, medians: the machine may be shared) beside the time to stream the same weights
once (a torch sum: the memory bound), and the LM head alone per rows (read once for all
rows: ~flat in rows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from hf_selfspec.kernels.attention import row_attention
from hf_selfspec.kernels.reference import row_attention_reference


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


SMOLLM2 = dict(hidden=576, intermediate=1536, layers=30, vocab=49152, heads=9, kv_heads=3, head_dim=64)


def bench_cpu_rows(args) -> None:
    """Products of one step (see the module docstring), 1..n threads side by side."""
    import platform
    import statistics

    from hf_selfspec.kernels.cpu_rows import build_error, load_rows_linear

    kernels = {"kernel": load_rows_linear()}
    if kernels["kernel"] is None:
        raise SystemExit(f"the C++ kernel is not available: {build_error()}")
    if args.pool:  # the same kernel on its work-sharing pool instead of OpenMP
        from hf_selfspec.kernels.cpu_rows import use_work_pool

        def pooled(x, w, _f=kernels["kernel"]):
            use_work_pool(True)
            try:
                return _f(x, w)
            finally:
                use_work_pool(False)

        kernels["pool"] = pooled
    if args.baseline:  # another cpu_rows.cpp (e.g. `git show REV:kernels/cpu_rows.cpp`), same flags
        from torch.utils.cpp_extension import load_inline

        kernels["baseline"] = load_inline(
            name="selfspec_cpu_rows_baseline", cpp_sources=[open(args.baseline).read()],
            functions=["rows_linear"], extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
            extra_ldflags=["-fopenmp"]).rows_linear
    m = SMOLLM2
    H, inter, d = m["hidden"], m["intermediate"], m["head_dim"]
    layer_shapes = [(m["heads"] * d, H), (m["kv_heads"] * d, H), (m["kv_heads"] * d, H), (H, m["heads"] * d),
                    (inter, H), (inter, H), (H, inter)]
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        layers = [(torch.randn(o, k, generator=gen) * k ** -0.5).to(dtype)
                  for _ in range(m["layers"]) for o, k in layer_shapes]
        weights[name] = (layers, (torch.randn(m["vocab"], H, generator=gen) * H ** -0.5).to(dtype))
    xs = {r: {k: torch.randn(r, k, generator=gen) for k in (H, inter)} for r in args.rows}
    threads0 = torch.get_num_threads()

    def step(linear, name, rows):
        layers, head = weights[name]
        x = xs[rows]
        for w in layers:
            linear(x[w.shape[1]], w)
        linear(x[H], head)

    def head_only(linear, name, rows):
        linear(xs[rows][H], weights[name][1])

    def stream(name):  # every weight byte read once
        layers, head = weights[name]
        for w in layers:
            w.sum()
        head.sum()

    cases = {}
    for t in args.threads:
        for name in args.dtypes:
            cases[("sum", t, name, 0, "")] = lambda name=name: stream(name)
            for r in args.rows:
                for kname, fn in kernels.items():
                    if kname == "baseline" and name != "float32":
                        continue
                    cases[("step", t, name, r, kname)] = lambda fn=fn, name=name, r=r: step(fn, name, r)
                    cases[("head", t, name, r, kname)] = lambda fn=fn, name=name, r=r: head_only(fn, name, r)
    samples = {key: [] for key in cases}
    for rnd in range(1 + args.repeats):  # round 0: warm-up
        for key, fn in cases.items():
            torch.set_num_threads(key[1])
            start = time.perf_counter()
            fn()
            if rnd:
                samples[key].append((time.perf_counter() - start) * 1e3)
    torch.set_num_threads(threads0)
    med = {key: statistics.median(v) for key, v in samples.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU {cpu}; {os.cpu_count()} cores; torch {torch.__version__}; medians of {args.repeats} rounds (ms)")
    for name in args.dtypes:
        layers, head = weights[name]
        mb = (sum(w.numel() for w in layers) + head.numel()) * head.element_size() / 1e6
        print(f"\n{name}: {mb:.0f} MB of weights per step (211 products), "
              f"LM head {head.numel() * head.element_size() / 1e6:.0f} MB")
        print(f"{'what':<23}" + "".join(f"{f'{t} thr ms':>11}" for t in args.threads)
              + (f"{'ratio':>8}" if len(args.threads) > 1 else "") + f"{'GB/s':>7}")
        rows_list = [("sum", 0, "")] + [(kind, r, k) for kind in ("step", "head") for r in args.rows
                                        for k in kernels if (kind, args.threads[0], name, r, k) in med]
        for kind, r, kname in rows_list:
            times = [med[(kind, t, name, r, kname)] for t in args.threads]
            label = "stream (sum)" if kind == "sum" else f"{kind} {r} row{'s' * (r > 1)}"
            label += {"baseline": " (base)", "pool": " (pool)"}.get(kname, "")
            ratio = f"{times[0] / times[-1]:>8.2f}" if len(times) > 1 else ""
            gb = (head.numel() * head.element_size() / 1e6 if kind == "head" else mb) / times[-1]
            print(f"{label:<23}" + "".join(f"{t:>11.2f}" for t in times) + ratio + f"{gb:>7.1f}")


def main() -> None:
    if "--cpu-rows" in sys.argv:
        parser = argparse.ArgumentParser(description="C++ row products of one step")
        parser.add_argument("--cpu-rows", action="store_true")
        parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
        parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
        parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                            choices=["float32", "bfloat16", "float16"])
        parser.add_argument("--repeats", type=int, default=7)
        parser.add_argument("--baseline", help="a cpu_rows.cpp to time beside this one (float32 rows)")
        parser.add_argument("--pool", action="store_true", help="also time the kernel on its own thread pool")
        bench_cpu_rows(parser.parse_args())
        return
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
