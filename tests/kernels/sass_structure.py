#!/usr/bin/env python3
"""Checks, in the SASS of the Hopper attention kernels a build compiled (sm_90a), that the
exponentials of the main loop run while an MMA is still in flight: from the loop's first
`WARPGROUP.DEPBAR.LE gsb0, 0x1` (wait for all but the newest group) to its last
`MUFU.EX2`, no `WARPGROUP.DEPBAR.LE gsb0, 0x0` (wait for all). ptxas is free to move a
wait earlier, and did (docs/kernels.md, "Overlap within a warpgroup"): the forward's
softmax then ran after P V instead of beside it, which no test of results can see. The
main loop is the innermost loop holding both HGMMA and MUFU.EX2.

  python3 tests/kernels/sass_structure.py --build BUILD_DIR

Exit 0: every kernel passes; 1: one does not; 77: nothing to check (no sm_90a objects).
cuobjdump comes from PATH or from PyPI into BUILD_DIR/tools (scripts/kernel_sass.py).
"""
import argparse
import glob
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import kernel_sass  # noqa: E402  (tools: cuobjdump from PATH or PyPI)

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)")


def instructions(function_sass):
    """(address, text) of each instruction."""
    return [(int(a, 16), t) for a, t in LINE.findall(function_sass)]


def main_loop(insns):
    """(first, last) address of the innermost backward branch's range holding HGMMA and MUFU.EX2."""
    best = None
    for addr, text in insns:
        m = BRANCH.search(text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo, hi = int(m.group(1), 16), addr
        body = [t for a, t in insns if lo <= a <= hi]
        if any("HGMMA" in t for t in body) and any("MUFU.EX2" in t for t in body):
            if best is None or hi - lo < best[1] - best[0]:
                best = (lo, hi)
    return best


def check(function_sass):
    """None when the loop's exponentials run beside an MMA in flight, else what is wrong."""
    insns = instructions(function_sass)
    loop = main_loop(insns)
    if loop is None:
        return "no loop with HGMMA and MUFU.EX2"
    body = [(a, t) for a, t in insns if loop[0] <= a <= loop[1]]
    first_partial = next((a for a, t in body if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t), None)
    last_exp = max((a for a, t in body if "MUFU.EX2" in t), default=None)
    if first_partial is None:
        return "no WARPGROUP.DEPBAR.LE gsb0, 0x1 in the loop"
    full = [a for a, t in body if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t and first_partial < a < last_exp]
    if full:
        return (f"WARPGROUP.DEPBAR.LE gsb0, 0x0 at {full[0]:#x}, between the loop's first partial wait "
                f"({first_partial:#x}) and its last MUFU.EX2 ({last_exp:#x})")
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    args = ap.parse_args()
    objects = sorted(glob.glob(os.path.join(args.build, "kernels", "**", "flash_*_sm90_*.o"), recursive=True))
    if not objects:
        print("sass_structure: no Hopper attention objects (built without sm_90a): nothing to check")
        return 77
    try:
        env = kernel_sass.tools(args.build)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"sass_structure: no cuobjdump on PATH and none from PyPI ({e}): nothing checked")
        return 77
    failed = 0
    for obj in objects:
        sass = subprocess.run(["cuobjdump", "-sass", "-arch", "sm_90a", obj], env=env, capture_output=True,
                              text=True, check=True).stdout
        parts = [p for p in re.split(r"\n\s+Function : ", sass)[1:] if "HGMMA" in p]  # not delta, dQ conversion
        mangled = [p.split("\n", 1)[0].strip() for p in parts]
        names = kernel_sass.demangle(mangled)
        for part, name in zip(parts, (names[m] for m in mangled)):
            problem = check(part)
            print(f"{'ok  ' if problem is None else 'FAIL'} {re.sub(r'[(].*', '', name)}"
                  + ("" if problem is None else f"\n     {problem}"))
            failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
