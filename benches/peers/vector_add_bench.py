#!/usr/bin/env python3
"""Peer baseline for `cargo bench --bench vector_add`: a Triton vector add, PyTorch's add and
PyTorch's device-to-device copy, timed the way our Rust bench times its kernels.

For N = 2^16 ... 2^28 float32 elements:
  * rotation: several input/output sets that together cover 1 GiB, one operation per set per
    timed round, so small N are read from device memory rather than from the L2 cache;
  * CUDA events around each round, 2 warm-up rounds, median of 10, divided by the sets;
  * bandwidth counts 12 bytes per element for c = a + b and 8 for the copy;
  * the Triton and PyTorch adds are checked against a + b computed by PyTorch (exact equality).

Writes bench-results/peers_vector_add.csv with the columns of our bench/vector_add.csv:
    impl,n,bytes,ms,gb_per_s,fraction_of_copy,status
`benches/peers/merge.py` puts both side by side.
"""
import argparse
import csv
import os
import statistics
import sys

ROTATION_BYTES = 1 << 30
MAX_SETS = 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench-results/peers_vector_add.csv")
    p.add_argument("--min-log2", type=int, default=16)
    p.add_argument("--max-log2", type=int, default=28)
    args = p.parse_args()
    try:
        import torch
        import triton
        import triton.language as tl
    except ImportError as e:
        sys.exit(f"vector_add_bench: needs PyTorch with CUDA and Triton ({e})")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch")

    @triton.jit
    def add_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(a_ptr + offsets, mask=mask)
        b = tl.load(b_ptr + offsets, mask=mask)
        tl.store(c_ptr + offsets, a + b, mask=mask)

    def triton_add(a, b, c):
        n = a.numel()
        add_kernel[(triton.cdiv(n, 1024),)](a, b, c, n, BLOCK=1024)

    impls = {
        "copy-torch": (8, lambda a, b, c: c.copy_(a)),
        "triton": (12, triton_add),
        "torch-add": (12, lambda a, b, c: torch.add(a, b, out=c)),
    }
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    torch.manual_seed(0)
    rows = []
    for log2_n in range(args.min_log2, args.max_log2 + 1):
        n = 1 << log2_n
        sets = max(1, min(MAX_SETS, -(-ROTATION_BYTES // (12 * n))))
        a = [torch.randn(n, device="cuda") for _ in range(sets)]
        b = [torch.randn(n, device="cuda") for _ in range(sets)]
        c = [torch.empty(n, device="cuda") for _ in range(sets)]
        copy_gbs = None
        for name, (bytes_per, op) in impls.items():
            for x in c:
                x.fill_(float("nan"))

            def one_round():
                for i in range(sets):
                    op(a[i], b[i], c[i])

            for _ in range(2):
                one_round()
            # Rounds queued back to back, events read at the end (as attn_host::timing::time_gpu).
            events = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                one_round()
                end.record()
                events.append((start, end))
            torch.cuda.synchronize()
            ms = statistics.median(start.elapsed_time(end) / sets for start, end in events)
            expected = (lambda i: a[i]) if name.startswith("copy") else (lambda i: a[i] + b[i])
            for i in (0, sets - 1):
                if not torch.equal(c[i], expected(i)):
                    sys.exit(f"{name} at N = 2^{log2_n}: wrong result")
            gbs = bytes_per * n / (ms * 1e-3) / 1e9
            if name.startswith("copy"):
                copy_gbs = gbs
            rows.append([name, n, bytes_per * n, f"{ms:.6f}", f"{gbs:.1f}", f"{gbs / copy_gbs:.4f}", "ok"])
            print(f"2^{log2_n:<3} {name:11} {ms * 1e3:10.2f} us {gbs:8.0f} GB/s  {100 * gbs / copy_gbs:5.1f} % of copy")
        del a, b, c
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["impl", "n", "bytes", "ms", "gb_per_s", "fraction_of_copy", "status"])
        w.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
