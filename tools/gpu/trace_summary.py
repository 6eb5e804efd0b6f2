#!/usr/bin/env python3
"""Where a profiled step's time goes, from one rank's Kineto trace (the trainer's "profile" section).

    python3 tools/gpu/trace_summary.py RUN/profile/rank-0.trace.json [traced steps = 2] [top = 40]

Prints the d9d phases (host time per step, from the user annotations), the GPU kernel time per
step and its launches, the kernels by total time per step, and each stream's busy time against
the traced span (what the compute stream leaves idle).
"""
import collections
import json
import sys


def main() -> None:
    trace = json.load(open(sys.argv[1]))
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    phases = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("d9d::"):
            phases[e["name"]] += e["dur"] / 1000 / steps
    print("phases (ms per step, host time):")
    for name, ms in sorted(phases.items(), key=lambda x: -x[1]):
        print(f"  {ms:9.2f}  {name}")
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") == "kernel":
            k = kernels[e["name"][:110]]
            k[0] += e["dur"] / 1000 / steps
            k[1] += 1
    total = sum(v[0] for v in kernels.values())
    launches = sum(v[1] for v in kernels.values()) // steps
    print(f"GPU kernel time per step: {total:.2f} ms, {launches} launches")
    for name, (ms, n) in sorted(kernels.items(), key=lambda x: -x[1][0])[:top]:
        print(f"  {ms:8.2f} ms {100 * ms / max(total, 1e-9):5.1f}%  x{n // steps:<5d} {name}")
    # Per stream: kernel time, and the share of the traced span it was busy (the span runs from
    # the first kernel to the end of the last, on any stream).
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    if not spans:
        return
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    streams = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            streams[e.get("tid")].append(e)
    print(f"streams (traced span {span / 1000 / steps:.2f} ms per step):")
    for tid, kernels_on in sorted(streams.items(), key=lambda x: -sum(e["dur"] for e in x[1])):
        busy = sum(e["dur"] for e in kernels_on)
        nccl = sum(e["dur"] for e in kernels_on if "nccl" in e["name"].lower())
        print(f"  stream {tid}: {busy / 1000 / steps:9.2f} ms busy ({100 * busy / span:5.1f}% of the "
              f"span), of which NCCL {nccl / 1000 / steps:.2f} ms, {len(kernels_on) // steps} kernels")


if __name__ == "__main__":
    main()
