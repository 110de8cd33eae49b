#!/usr/bin/env python3
"""Two or more builds or settings of our forward, interleaved on one GPU, with cuDNN and FA2 beside them.

A kernel change is judged against the code it replaces in the same device run, on the same inputs
(PERFORMANCE.md's method). Each *variant* is a binary and, optionally, environment variables:

    python3 benches/peers/ab.py --variant main=main/rust-attention --variant new=target/release/rust-attention \
        --shapes 256x12x197x64:f16,16x12x1024x64:f16:causal
    python3 benches/peers/ab.py --variant m192=target/release/rust-attention \
        --variant m64=target/release/rust-attention:RUST_ATTENTION_HOPPER_BLOCK_M=64 --shapes 64x16x577x64:bf16

A variant is `NAME=BINARY[:KEY=VALUE[;KEY=VALUE...]]`. For every shape the variants run in the
order A B … then … B A, `--rounds` times (ABBA for two), each run `rust-attention attn --random …
--forward-only` (CUDA events, warm-up, median of `--repeats`); a variant's cell is the median of its
runs, the runs themselves are printed as they come so that noise shows. Then PyTorch SDPA's cuDNN and
FA2 backends on the same shapes (`side_by_side.py`'s `peers`), and one markdown table: TFLOP/s of
each variant with its kernel label, each later variant's ratio to the first, and the peers.
Shapes as in `side_by_side.py`: `BxHxNxD` or `BxHqxHkvxNxD`, then `:dtype`, then `:causal`.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import ours, parse, peers  # noqa: E402  (beside this file)


def variant(spec):
    """'NAME=BINARY[:K=V;K=V]' -> (name, binary, env)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"{spec!r} is not NAME=BINARY[:KEY=VALUE;...]")
    binary, _, settings = rest.partition(":")
    env = {}
    for setting in filter(None, settings.split(";")):
        key, sep, value = setting.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{setting!r} in {spec!r} is not KEY=VALUE")
        env[key] = value
    return name, binary, env


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", type=variant, action="append", required=True, help="NAME=BINARY[:KEY=VALUE;...]")
    p.add_argument("--shapes", required=True, help="comma list of shapes, as side_by_side.py's")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds per shape (default 1)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--no-peers", action="store_true", help="skip cuDNN and FA2")
    args = p.parse_args()
    if len(args.variant) < 2:
        p.error("give at least two --variant")
    cases = [parse(s) for s in args.shapes.split(",") if s]
    names = [name for name, _, _ in args.variant]
    order = list(range(len(names)))
    order = (order + order[::-1]) * args.rounds

    results = []
    for case in cases:
        runs, labels = {n: [] for n in names}, {}
        for i in order:
            name, binary, env = args.variant[i]
            got = ours(binary, case, args.warmup, args.repeats, env, forward_only=True).get("forward")
            if got:
                runs[name].append(got[0])
                labels[name] = got[1]
        print(f"{case}: " + ", ".join(f"{n} {[round(x, 1) for x in runs[n]]}" for n in names), file=sys.stderr)
        results.append((case, {n: statistics.median(r) if r else None for n, r in runs.items()}, labels))

    theirs = {} if args.no_peers else peers(cases, args.warmup, args.repeats)
    cell = lambda x: f"{x:.1f}" if x else "—"
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "—"
    print("| shape [B, Hq, Hkv, N, D] | dtype | mask | " + " | ".join(f"{n} (kernel)" for n in names)
          + "".join(f" | {n} ÷ {names[0]}" for n in names[1:]) + " | cuDNN | FA2 |")
    print("|---|---|---|" + "---|" * len(names) + "---:|" * (len(names) - 1) + "---:|---:|")
    for case, tflops, labels in results:
        b, hq, hkv, n, d, dtype, causal = case
        mine = " | ".join(f"{cell(tflops[x])} ({labels.get(x, 'not taken')})" for x in names)
        ratios = "".join(f" | {ratio(tflops[x], tflops[names[0]])}" for x in names[1:])
        peer = f" | {cell(theirs.get((case, 'cudnn', 'forward')))} | {cell(theirs.get((case, 'fa2', 'forward')))} |"
        print(f"| [{b}, {hq}, {hkv}, {n}, {d}] | {dtype} | {'causal' if causal else 'none'} | {mine}{ratios}{peer}")


if __name__ == "__main__":
    main()
