#!/usr/bin/env python3
"""Where a profiled step's time goes, from one rank's Kineto trace (the trainer's "profile" section).

    python3 tools/gpu/trace_summary.py RUN/profile/rank-0.trace.json [traced steps = 2] [top = 40]

Prints the d9d phases (host time per step, from the user annotations), the GPU kernel time per
step and its launches, the kernels by total time per step, and each stream's busy time against
the traced span (what the compute stream leaves idle), and then the compute stream's idle gaps:
whether the host had not yet launched the next kernel ("host late") or had launched it and the
stream was waiting ("stream waited"), the d9d annotation and the operator the host was inside
when the stream ran dry, what the other streams ran while it waited (a side stream's kernels or
same-device copies hold the SMs the next kernel needs), and the synchronising runtime calls during
the gap; and the host's
synchronisations per step (stream, device, event), by annotation and operator.
"""
import bisect
import collections
import json
import re
import sys


def read_trace(argv):
    """The complete events of the trace argv[1], and the traced steps (argv[2], default 2) and how
    many rows to list (argv[3], default 40): the command line of this script and host_ops.py."""
    trace = json.load(open(argv[1]))
    steps = int(argv[2]) if len(argv) > 2 else 2
    top = int(argv[3]) if len(argv) > 3 else 40
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"], steps, top


def main() -> None:
    events, steps, top = read_trace(sys.argv)
    phases = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("d9d::"):
            # The pipeline's actions ("d9d::pipeline::2F3") by stage and kind.
            name = re.sub(r"^(d9d::pipeline::\d+[A-Z]+)\d+$", r"\1", e["name"])
            phases[name] += e["dur"] / 1000 / steps
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

    gaps(events, steps)
    synchronisations(events, steps)


def synchronisations(events, steps, top=12):
    """The host's waits for the GPU (stream, device and event synchronisations) per step, by the
    d9d annotation and the chain of operators they ran in: each lets the GPU run dry until the host
    has launched the next work."""
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in
             ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")]
    if not waits:
        return
    annotations = Spans(e for e in events
                        if e.get("cat") == "user_annotation" and e["name"].startswith("d9d::"))
    operators = [e for e in events if e.get("cat") == "cpu_op"]
    by_tid = collections.defaultdict(list)
    for e in operators:
        by_tid[e.get("tid")].append(e)
    for spans in by_tid.values():
        spans.sort(key=lambda e: e["ts"])
    rows = collections.defaultdict(lambda: [0.0, 0])
    for w in waits:
        where = annotations.innermost(w["ts"])
        spans = by_tid.get(w.get("tid"), [])
        k = bisect.bisect_right([e["ts"] for e in spans], w["ts"])
        chain = [e["name"] for e in spans[max(0, k - 200):k]
                 if e["ts"] + e["dur"] >= w["ts"] + w["dur"]]
        key = (where["name"] if where else "-", " > ".join(chain[:2]) if chain else "-")
        rows[key][0] += w["dur"]
        rows[key][1] += 1
    total = sum(n for _, n in rows.values())
    print(f"host synchronisations: {total / steps:.1f} per step, "
          f"{sum(us for us, _ in rows.values()) / 1000 / steps:.2f} ms per step waited; by the "
          "annotation and the outer operators:")
    for (where, chain), (us, n) in sorted(rows.items(), key=lambda x: -x[1][1])[:top]:
        print(f"  {n / steps:6.1f} x  {us / 1000 / steps:7.2f} ms  {where[:30]:<30} {chain[:70]}")


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaMalloc", "cudaFree", "cudaHostAlloc")


class Spans:
    """Host spans of one kind (annotations or operators), innermost lookup at a time."""

    def __init__(self, spans):
        self.spans = sorted(spans, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.spans]

    def innermost(self, t, tid=None):
        best = None
        k = bisect.bisect_right(self.starts, t)
        for e in self.spans[max(0, k - 4000):k]:
            if e["ts"] <= t <= e["ts"] + e["dur"] and (tid is None or e.get("tid") == tid):
                if best is None or e["dur"] < best["dur"]:
                    best = e
        return best


def device_kind(name):
    """A short name for a device activity: the copy's kind, or the kernel's name up to its
    arguments and template parameters."""
    if name.startswith("Memcpy") or name.startswith("Memset"):
        return name.split(" (")[0]
    return re.split(r"[<(]", name.replace("void ", "", 1))[0][:40]


def gaps(events, steps, threshold_us=5.0, top=20):
    """The compute stream's idle gaps, classified (see the module's text)."""
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not device:
        return
    busy = collections.Counter()
    for e in device:
        if "nccl" not in e["name"].lower():
            busy[e.get("tid")] += e["dur"]
    stream = busy.most_common(1)[0][0]
    on = sorted((e for e in device if e.get("tid") == stream), key=lambda e: e["ts"])
    launches = {}
    runtime = []
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime.append(e)
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launches[c] = e
    runtime.sort(key=lambda e: e["ts"])
    runtime_starts = [e["ts"] for e in runtime]
    annotations = Spans(e for e in events
                        if e.get("cat") == "user_annotation" and e["name"].startswith("d9d::"))
    operators = Spans(e for e in events if e.get("cat") == "cpu_op")
    # The other streams' device work, to say what ran while the stream waited.
    others = sorted((e for e in device if e.get("tid") != stream), key=lambda e: e["ts"])
    other_starts = [e["ts"] for e in others]
    longest = max((e["dur"] for e in others), default=0.0)
    beside = collections.defaultdict(lambda: [0.0, 0])
    classes = collections.Counter()
    counts = collections.Counter()
    rows = collections.defaultdict(lambda: [0.0, 0])
    syncs = collections.Counter()
    idle = 0.0
    for prev, nxt in zip(on, on[1:]):
        start, end = prev["ts"] + prev["dur"], nxt["ts"]
        if end - start < threshold_us:
            continue
        idle += end - start
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        late = launch is not None and launch["ts"] > start
        kind = "host late" if late else "stream waited"
        classes[kind] += end - start
        counts[kind] += 1
        where = annotations.innermost(launch["ts"] if launch else end)
        tid = launch.get("tid") if launch else None
        doing = operators.innermost(start, tid) if late else None
        key = (kind, where["name"] if where else "-", doing["name"] if doing else "-")
        rows[key][0] += end - start
        rows[key][1] += 1
        if not late:
            lo = bisect.bisect_left(other_starts, start - longest)
            hi = bisect.bisect_left(other_starts, end)
            ran = ", ".join(sorted({device_kind(e["name"]) for e in others[lo:hi]
                                    if e["ts"] + e["dur"] > start})) or "nothing"
            beside[ran][0] += end - start
            beside[ran][1] += 1
        lo = bisect.bisect_left(runtime_starts, start - 1e6)
        for r in runtime[lo: bisect.bisect_right(runtime_starts, end)]:
            overlap = min(end, r["ts"] + r["dur"]) - max(start, r["ts"])
            if overlap > 0 and r["name"] in SYNCS:
                syncs[r["name"]] += overlap
    span = on[-1]["ts"] + on[-1]["dur"] - on[0]["ts"]
    print(f"compute stream {stream}: gaps >= {threshold_us:.0f} us add up to {idle / 1000 / steps:.2f}"
          f" ms per step ({100 * idle / span:.1f}% of its span)")
    for kind, us in classes.most_common():
        print(f"  {kind:<14} {us / 1000 / steps:8.2f} ms per step in {counts[kind] // steps} gaps")
    print("  by the annotation of the next launch and the operator the host was in when the stream "
          "ran dry:")
    for (kind, where, doing), (us, n) in sorted(rows.items(), key=lambda x: -x[1][0])[:top]:
        print(f"  {us / 1000 / steps:8.2f} ms x{n // max(steps, 1):<4d} {kind:<13} "
              f"{where[:40]:<40} {doing[:60]}")
    if beside:
        print("  the stream waited while the other streams ran:")
        for ran, (us, n) in sorted(beside.items(), key=lambda x: -x[1][0])[:top]:
            print(f"  {us / 1000 / steps:8.2f} ms x{n // max(steps, 1):<4d} {ran[:100]}")
    if syncs:
        print("  runtime calls overlapping the gaps (ms per step): " + ", ".join(
            f"{name} {us / 1000 / steps:.2f}" for name, us in syncs.most_common()))


if __name__ == "__main__":
    main()
