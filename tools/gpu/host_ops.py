#!/usr/bin/env python3
"""What the host issues in a profiled step, from one rank's Kineto trace: the outermost operators of
each thread (the training thread's modules' ops, the autograd engine's nodes) per step, with their
host time and the kernels they launch; and inside the autograd nodes, the operators they run.

    python3 tools/gpu/host_ops.py RUN/profile/rank-0.trace.json [traced steps = 2] [top = 40]

A step that is host-bound (the GPU waits for launches, tools/gpu/trace_summary.py's "host late"
gaps) gets faster by issuing fewer operators: this lists which ones, and how many per step.
"""
import bisect
import collections
import re
import sys

from trace_summary import read_trace  # this directory, which Python puts first on the path

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaMemcpyAsync", "cudaMemsetAsync", "cudaLaunchCooperativeKernel")


def outermost(spans):
    """Each span with its depth among the spans of its thread (0: outermost)."""
    spans.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack, out = [], []
    for e in spans:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        out.append((e, len(stack), stack[0] if stack else e, stack[-1] if stack else None))
        stack.append(e)
    return out


def name_of(e):
    # The autograd engine's nodes: "autograd::engine::evaluate_function: MmBackward0".
    return re.sub(r"^autograd::engine::evaluate_function: ", "node ", e["name"])[:90]


def main() -> None:
    events, steps, top = read_trace(sys.argv)
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e.get("tid")].append(e)
    launches = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in LAUNCHES:
            launches[e.get("tid")].append(e["ts"])
    for ts in launches.values():
        ts.sort()

    rows = collections.defaultdict(lambda: [0, 0.0, 0])     # outermost: count, host us, launches
    inner = collections.defaultdict(lambda: [0, 0.0, 0])    # inside autograd nodes: depth 1
    threads = collections.defaultdict(lambda: [0, 0.0, 0])
    for tid, spans in ops.items():
        starts = launches.get(tid, [])
        for e, depth, root, parent in outermost(spans):
            lo = bisect.bisect_left(starts, e["ts"])
            hi = bisect.bisect_right(starts, e["ts"] + e["dur"])
            if depth == 0:
                for table, key in ((rows, name_of(e)), (threads, tid)):
                    table[key][0] += 1
                    table[key][1] += e["dur"]
                    table[key][2] += hi - lo
            elif root["name"].startswith("autograd::engine") and (
                    depth == 2 or (depth == 1 and e["name"] != name_of(root)[5:])):
                # The operators a node runs: under its function's span (depth 2), or beside it.
                key = name_of(root)[5:40] + " > " + e["name"][:50]
                inner[key][0] += 1
                inner[key][1] += e["dur"]
                inner[key][2] += hi - lo

    print("threads: outermost operators per step, their host time and launches")
    for tid, (n, us, k) in sorted(threads.items(), key=lambda x: -x[1][1]):
        print(f"  thread {str(tid)[:12]:<12} {n / steps:9.0f} ops {us / 1000 / steps:9.2f} ms "
              f"{k / steps:8.0f} launches")
    total = sum(v[0] for v in rows.values())
    print(f"outermost operators by host time ({total / steps:.0f} per step; count, ms, launches "
          "per step):")
    for key, (n, us, k) in sorted(rows.items(), key=lambda x: -x[1][1])[:top]:
        print(f"  x{n / steps:<7.0f} {us / 1000 / steps:8.2f} ms {k / steps:7.0f} L  {key}")
    print("inside the autograd nodes (node > operator; count, ms, launches per step):")
    for key, (n, us, k) in sorted(inner.items(), key=lambda x: -x[1][1])[:top]:
        print(f"  x{n / steps:<7.0f} {us / 1000 / steps:8.2f} ms {k / steps:7.0f} L  {key}")


if __name__ == "__main__":
    main()
