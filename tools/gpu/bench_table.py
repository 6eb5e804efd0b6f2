#!/usr/bin/env python3
"""One table per model shape from tools/gpu/parallel-bench's logs.

    python3 tools/gpu/bench_table.py OUT_DIR

Reads every OUT_DIR/*.log that reports a throughput (the quickstart's "model: ...; throughput:"
line and its "peak memory:" line) and groups the runs by parameter count. In each group the run
over one rank, if any, is the baseline: "per GPU / one GPU" is (tokens/s / ranks) over the
baseline's tokens/s, for the runs of the same part (the log name's first word: `scale_*` runs
give every rank the baseline's batch, so this is their weak-scaling efficiency). Runs that
failed are listed with their log's name.
"""
import collections
import pathlib
import re
import sys

THROUGHPUT = re.compile(
    r"model: ([0-9.]+)M parameters; throughput: ([0-9]+) tokens/s over ([0-9]+) rank\(s\), "
    r"([0-9.]+) TFLOP/s per rank, MFU ([0-9.]+)%")
PEAK = re.compile(r"peak memory: ([0-9.]+) GiB")


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    shapes = collections.defaultdict(list)
    failed = []
    for log in sorted(out.glob("*.log")):
        if log.name in ("configure.log", "build.log"):
            continue
        text = log.read_text(errors="replace")
        runs = THROUGHPUT.findall(text)
        if not runs:
            failed.append(log.stem)
            continue
        params, tokens, ranks, _, mfu = runs[-1]
        peaks = PEAK.findall(text)
        shapes[params].append((log.stem, int(tokens), int(ranks), float(mfu),
                               peaks[-1] if peaks else "-"))
    for params, runs in sorted(shapes.items(), key=lambda item: float(item[0])):
        base, part = next(((tokens, name.split("_")[0]) for name, tokens, ranks, _, _ in runs
                           if ranks == 1), (None, None))
        print(f"\n{params}M parameters" + (f" (one GPU: {base:,} tokens/s)" if base else ""))
        print("| run | ranks | tokens/s | per GPU / one GPU | MFU | peak GiB |")
        print("|---|---|---|---|---|---|")
        for name, tokens, ranks, mfu, peak in runs:
            ratio = f"{tokens / ranks / base:.3f}" if name.split("_")[0] == part else "-"
            print(f"| {name} | {ranks} | {tokens:,} | {ratio} | {mfu:.1f}% | {peak} |")
    if failed:
        print("\nno throughput (see the logs): " + ", ".join(failed))


if __name__ == "__main__":
    main()
