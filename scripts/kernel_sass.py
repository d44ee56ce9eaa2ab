#!/usr/bin/env python3
"""Static figures of the compiled CUDA kernels, for machines without a GPU.

scripts/kernel_sass.py [--build DIR] [--arch sm_90a] [--filter REGEX] [--json FILE]

Reads the kernel objects of a build (DIR/kernels/**/*.o), disassembles the SASS of one
architecture and prints, per kernel: registers, local-memory stack (spills), the
instruction count of the whole function, tensor-core MMAs (HMMA: mma.sync; HGMMA:
Hopper's wgmma, each 64 x N x 16 where an HMMA is 16 x 8 x 16), shared-memory
fragment loads (LDSM) and plain shared loads (LDS), async copies (LDGSTS), spill
traffic (STL/LDL), global loads and stores (LDG, STG) with how many of them move 16 bytes
(.128: the memory-bound kernels' vector accesses) and instructions per MMA. These are counts of the code, not of its
execution: they say where a kernel spends instructions, never how fast it runs.
cuobjdump and nvdisasm come from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)
into DIR/tools when they are not on PATH.
"""
import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys


def tools(build):
    if shutil.which("cuobjdump") and shutil.which("nvdisasm"):
        return os.environ.copy()
    target = os.path.join(build, "tools")
    bindir = os.path.join(target, "nvidia", "cu13", "bin")
    if not os.path.exists(os.path.join(bindir, "nvdisasm")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", target,
                        "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"], check=True)
    for exe in ("cuobjdump", "nvdisasm"):
        os.chmod(os.path.join(bindir, exe), 0o755)
    env = os.environ.copy()
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def demangle(names):
    if not names or not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return dict(zip(names, out))


INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
GLOBAL = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?((?:LDG|STG)[.A-Z0-9_]*)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--filter", default=".")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    objects = sorted(glob.glob(os.path.join(args.build, "kernels", "**", "*.o"), recursive=True))
    if not objects:
        sys.exit(f"kernel_sass: no kernel objects under {args.build}/kernels (build the dtrain_kernels target)")
    env = tools(args.build)
    rows = []
    for obj in objects:
        res = subprocess.run(["cuobjdump", "-res-usage", "-arch", args.arch, obj], env=env, capture_output=True,
                             text=True, check=True).stdout
        usage = {f: (int(r), int(st)) for f, r, st in re.findall(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+)", res)}
        sass = subprocess.run(["cuobjdump", "-sass", "-arch", args.arch, obj], env=env, capture_output=True,
                              text=True, check=True).stdout
        for part in re.split(r"\n\s+Function : ", sass)[1:]:
            name = part.split("\n", 1)[0].strip()
            ops = collections.Counter(INSN.findall(part))
            wide = collections.Counter(op[:3] for op in GLOBAL.findall(part) if ".128" in op)
            regs, stack = usage.get(name, (0, 0))
            rows.append({"object": os.path.basename(obj), "kernel": name, "registers": regs, "stack_bytes": stack,
                         "instructions": sum(ops.values()), "hmma": ops["HMMA"], "hgmma": ops["HGMMA"],
                         "ldsm": ops["LDSM"],
                         "lds": ops["LDS"], "ldgsts": ops["LDGSTS"], "stl_ldl": ops["STL"] + ops["LDL"],
                         "ldg": ops["LDG"], "ldg128": wide["LDG"], "stg": ops["STG"], "stg128": wide["STG"]})
    names = demangle([r["kernel"] for r in rows])
    pattern = re.compile(args.filter)
    def short(mangled):  # "void ns::name<args>(params)" -> "name<args>"
        plain = re.sub(r"\(anonymous namespace\)::|dtrain_kernels::|^void ", "", names[mangled])
        return re.sub(r"\(.*", "", plain)

    rows = [dict(r, kernel=short(r["kernel"])) for r in rows]
    rows = [r for r in rows if pattern.search(r["kernel"])]
    print(f"{'kernel':58} {'regs':>4} {'stack':>5} {'insns':>6} {'HMMA':>5} {'HGMMA':>5} {'LDSM':>5} {'LDS':>4} "
          f"{'LDGSTS':>6} {'STL+LDL':>7} {'LDG(128)':>9} {'STG(128)':>9} {'insn/HMMA':>9}")
    for r in rows:
        per = f"{r['instructions'] / r['hmma']:.1f}" if r["hmma"] else "-"
        print(f"{r['kernel'][:58]:58} {r['registers']:>4} {r['stack_bytes']:>5} {r['instructions']:>6} "
              f"{r['hmma']:>5} {r['hgmma']:>5} {r['ldsm']:>5} {r['lds']:>4} {r['ldgsts']:>6} {r['stl_ldl']:>7} "
              f"{str(r['ldg']) + '(' + str(r['ldg128']) + ')':>9} {str(r['stg']) + '(' + str(r['stg128']) + ')':>9} {per:>9}")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, arch=args.arch)) + "\n")


if __name__ == "__main__":
    main()
