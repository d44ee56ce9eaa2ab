#!/usr/bin/env python3
"""The kernel issue's targets on one GPU, read off kernel_bench's JSON lines:
attention (bf16, S 4096, D 128, causal) forward >= 1.0x and backward >= 0.8x the best
scaled_dot_product_attention backend; fused AdamW >= 85% and the norms >= 80% of a device
copy of the same bytes. Prints one line per target (met, MISSED, or no figure) and exits 1
when one is missed or has no figure.

  python3 benchmarks/gpu/targets.py OUTDIR/kernel_bench.jsonl
"""
import json
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    lines = []
    with open(sys.argv[1]) as f:
        for text in f:
            text = text.strip()
            if text.startswith("{"):
                lines.append(json.loads(text))
    cuda = [j for j in lines if j.get("bench") == "kernel" and j.get("device") == "cuda"]

    def one(pred):
        found = [j for j in cuda if pred(j)]
        return found[-1] if found else None  # the latest run's

    attn = one(lambda j: j.get("op") == "attention" and j.get("seq") == 4096 and j.get("head_dim") == 128
               and j.get("causal") is True)
    targets = [("attention fwd, S 4096 D 128 causal, / best sdpa", attn and attn.get("fwd_ratio"), 1.0),
               ("attention bwd, S 4096 D 128 causal, / best sdpa", attn and attn.get("bwd_ratio"), 0.8)]
    for op, passes, floor in [("adamw", ["step"], 0.85), ("rms_norm", ["fwd", "bwd"], 0.8),
                              ("layer_norm", ["fwd", "bwd"], 0.8)]:
        for p in passes:
            j = one(lambda j: j.get("op") == op and j.get("pass") == p)
            targets.append((f"{op} {p}, fraction of copy", j and j.get("fraction_of_copy"), floor))
    ok = True
    print(f"{'target':52} {'measured':>9} {'floor':>6}  verdict")
    for name, value, floor in targets:
        if not value:  # absent, or 0 when a side could not be timed
            verdict, shown = "no figure", "-"
            ok = False
        else:
            verdict, shown = ("met" if value >= floor else "MISSED"), f"{value:.2f}"
            ok = ok and value >= floor
        print(f"{name:52} {shown:>9} {floor:6.2f}  {verdict}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
