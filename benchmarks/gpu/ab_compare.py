#!/usr/bin/env python3
"""Compares two sets of kernel_bench JSON lines (benchmarks/gpu/ab.sh: the base tree's
runs and this tree's, several rounds each): per case and figure, the median of each side
and new / base. The figures are dtrain's own (attention TFLOP/s, GB/s of the memory-bound
ops) and its ratio to the same run's baseline (best sdpa backend, device copy), which
holds better on a noisy machine. Prints a table, then one JSON line per row
(bench "kernel_ab").

  python3 benchmarks/gpu/ab_compare.py BASE.jsonl NEW.jsonl
"""
import json
import statistics
import sys

# (figure, where it is) per kind of line: dtrain's figure and its in-run ratio.
ATTENTION = ["fwd_tflops", "fwd_ratio", "bwd_tflops", "bwd_ratio"]
MEMORY = ["gbps", "fraction_of_copy"]


def case_of(j):
    if j.get("op") == "attention":
        return (f"attention S{j['seq']} D{j['head_dim']} {'causal' if j['causal'] else 'full'}", ATTENTION)
    return (f"{j['op']} {j['pass']}", MEMORY)


def load(path):
    cases = {}
    with open(path) as f:
        for text in f:
            text = text.strip()
            if not text.startswith("{"):
                continue
            j = json.loads(text)
            if j.get("bench") != "kernel":
                continue
            name, figures = case_of(j)
            for fig in figures:
                if isinstance(j.get(fig), (int, float)) and j[fig] > 0:
                    cases.setdefault((name, fig), []).append(float(j[fig]))
    return cases


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    base, new = load(sys.argv[1]), load(sys.argv[2])
    keys = [k for k in base if k in new]
    if not keys:
        sys.exit("ab_compare: no case has figures on both sides")
    rows = []
    print(f"{'case':34} {'figure':18} {'base':>9} {'new':>9} {'new/base':>9} {'runs':>5}")
    for name, fig in keys:
        b, n = statistics.median(base[(name, fig)]), statistics.median(new[(name, fig)])
        rows.append({"bench": "kernel_ab", "case": name, "figure": fig, "base": b, "new": n, "new_over_base": n / b,
                     "runs": min(len(base[(name, fig)]), len(new[(name, fig)]))})
        print(f"{name:34} {fig:18} {b:9.3f} {n:9.3f} {n / b:9.3f} {rows[-1]['runs']:5d}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
