#!/usr/bin/env python3
"""Models how a causal attention grid ends on a GPU: the Hopper kernels' blocks (one per SM,
for their shared memory) start in launch order as SMs free up, each taking time in proportion
to its tiles. Prints the makespan over the ideal (total work / SMs) for the launch order the
kernels had (a (batch, head) pair's tiles in a row, heaviest first) and for tile_order
(kernels/attention/tile_order.cuh: sections of pairs sized for L2, every pair's heaviest tile
first within one). With --persistent, the forward's efficiency (ideal over makespan) when each
query block also costs a fixed overhead in key tiles: a launch per query block (overhead 1.76,
the fit of the H200's causal D 128 ratios 0.71 / 0.91 / 0.98 at S 1k / 4k / 16k), and a
persistent grid of one block per SM taking query blocks round-robin (static) or from a counter
(dynamic), with what overlap leaves of the overhead (0.3, a guess). A model, not a
measurement: kernel_bench times the kernels.

  python3 scripts/tile_order_model.py [--sms 132] [--persistent]
"""
import argparse
import heapq

L2_SECTION_BYTES = 32 << 20  # kL2SectionBytes


def tile_order(block, tiles, pairs, section):  # a transcription of tile_order()
    sections = (pairs + section - 1) // section
    base, small = pairs // sections, sections - pairs % sections
    boundary = small * base * tiles
    if block < boundary:
        g, first = base, block // (base * tiles) * base
    else:
        g = base + 1
        first = small * base + (block - boundary) // (g * tiles) * g
    r = block - first * tiles
    return first + r % g, r // g


def makespan(work, sms):
    free = [0.0] * sms
    end = 0.0
    for w in work:
        t = heapq.heappop(free) + w
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def round_robin(work, sms):
    loads = [0.0] * min(sms, len(work))
    for i, w in enumerate(work):
        loads[i % len(loads)] += w
    return max(loads)


def persistent(sms):
    launch, kept = 1.76, 0.3
    print(f"{'forward':8} {'B':>3} {'H':>3} {'S':>6} {'launch':>7} {'static':>7} {'dynamic':>7}")
    for b, h, s in [(16, 16, 1024), (4, 16, 4096), (1, 16, 16384), (4, 32, 4096)]:
        m, pairs = (s + 127) // 128, b * h
        section = max(1, L2_SECTION_BYTES // (s * 128 * 2 * 2))
        work = [m - tile_order(i, m, pairs, section)[1] for i in range(m * pairs)]
        ideal = sum(work) / sms
        eff = [ideal / makespan([w + launch for w in work], sms), ideal / round_robin([w + kept for w in work], sms),
               ideal / makespan([w + kept for w in work], sms)]
        print(f"{'causal':8} {b:3} {h:3} {s:6} " + " ".join(f"{e:7.3f}" for e in eff))


def ratios(tiles, pairs, work_of_rank, section, sms):
    before = [work_of_rank(r) for _ in range(pairs) for r in range(tiles)]
    after = [work_of_rank(tile_order(b, tiles, pairs, section)[1]) for b in range(tiles * pairs)]
    ideal = sum(before) / sms
    return makespan(before, sms) / ideal, makespan(after, sms) / ideal


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--persistent", action="store_true", help="the forward's persistent-grid model")
    a = ap.parse_args()
    if a.persistent:
        persistent(a.sms)
        return
    print(f"{'pass':8} {'B':>3} {'H':>3} {'S':>6} {'D':>4} {'section':>7} {'before':>7} {'after':>7}")
    for b, h, s, d in [(16, 16, 1024, 128), (4, 16, 4096, 128), (2, 16, 4096, 128), (1, 16, 16384, 128),
                       (16, 32, 1024, 64), (4, 32, 4096, 64), (1, 32, 16384, 64), (8, 12, 1024, 64)]:
        pairs = b * h
        # Forward: 128 query rows per block; block m sees m + 1 key tiles of 128.
        m = (s + 127) // 128
        section = max(1, L2_SECTION_BYTES // (s * d * 2 * 2))
        r0, r1 = ratios(m, pairs, lambda r: m - r, section, a.sms)
        print(f"{'forward':8} {b:3} {h:3} {s:6} {d:4} {section:7} {r0:7.3f} {r1:7.3f}")
        # Backward: 128 keys per block; key block n sees the query tiles of 64 from its first key.
        n = (s + 127) // 128
        section = max(1, L2_SECTION_BYTES // (s * d * (2 * 2 + 4)))
        r0, r1 = ratios(n, pairs, lambda r: (s - r * 128 + 63) // 64, section, a.sms)
        print(f"{'backward':8} {b:3} {h:3} {s:6} {d:4} {section:7} {r0:7.3f} {r1:7.3f}")


if __name__ == "__main__":
    main()
