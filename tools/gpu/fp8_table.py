#!/usr/bin/env python3
"""The tables of tools/gpu/fp8-bench: FP8 runs beside the bf16 run of their group.

    python3 tools/gpu/fp8_table.py LOG_DIR

Reads LOG_DIR/<group>_<variant>.log (the quickstart's "model: ...; throughput:" and "peak memory:"
lines) and LOG_DIR/<group>_<variant>.metrics.jsonl (the losses), groups the runs by the name up
to the variant (bf16, fp8_rowwise, fp8_tensorwise, fp8_gather, fp8_tensorwise_gather), and prints
per group: tokens/s, the ratio to the group's bf16 run, MFU (of the bf16 peak given to the run),
peak memory, the host's time issuing forward and backward per step (rank 0), the loss of the last
step and the mean of the last 10 logged losses, each with its relative difference to bf16's. Runs
that printed no throughput are listed as failed.
"""
import collections
import json
import pathlib
import re
import sys

THROUGHPUT = re.compile(
    r"model: ([0-9.]+)M parameters; throughput: ([0-9]+) tokens/s over ([0-9]+) rank\(s\), "
    r"([0-9.]+) TFLOP/s per rank(?:, MFU ([0-9.]+)%)?")
PEAK = re.compile(r"peak memory: ([0-9.]+) GiB")
HOST = re.compile(r"host time issuing forward \+ backward: ([0-9.]+) ms per step")
VARIANTS = ("bf16", "fp8_rowwise", "fp8_tensorwise", "fp8_gather", "fp8_tensorwise_gather")


def losses(path: pathlib.Path) -> list:
    if not path.exists():
        return []
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            out[record["step"]] = record["train/loss"]
    return [out[s] for s in sorted(out)]


def main() -> None:
    logs = pathlib.Path(sys.argv[1])
    groups = collections.defaultdict(dict)
    failed = []
    for log in sorted(logs.glob("*.log")):
        variant = next((v for v in VARIANTS if log.stem.endswith("_" + v)), None)
        if variant is None:
            continue
        group = log.stem[: -len(variant) - 1]
        runs = THROUGHPUT.findall(log.read_text(errors="replace"))
        if not runs:
            failed.append(log.stem)
            continue
        params, tokens, ranks, _, mfu = runs[-1]
        peaks = PEAK.findall(log.read_text(errors="replace"))
        host = HOST.findall(log.read_text(errors="replace"))
        curve = losses(logs / (log.stem + ".metrics.jsonl"))
        groups[group][variant] = {
            "params": float(params), "tokens": int(tokens), "ranks": int(ranks),
            "mfu": mfu or "-", "peak": peaks[-1] if peaks else "-",
            "host": host[-1] if host else "-", "curve": curve}
    for group, runs in sorted(groups.items()):
        base = runs.get("bf16")
        first = next(iter(runs.values()))
        print(f"\n## {group}: {first['params']:.0f}M parameters, {first['ranks']} GPU(s)")
        print("| run | tokens/s | / bf16 | MFU % | peak GiB | host ms/step | steps |"
              " last loss (vs bf16) | mean of last 10 (vs bf16) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for variant in VARIANTS:
            run = runs.get(variant)
            if run is None:
                continue
            ratio = f"{run['tokens'] / base['tokens']:.3f}" if base else "-"
            curve = run["curve"]
            last = tail = "-"
            if curve:
                last = f"{curve[-1]:.4f}"
                mean = sum(curve[-10:]) / len(curve[-10:])
                tail = f"{mean:.4f}"
                if base and base["curve"] and variant != "bf16":
                    b = base["curve"]
                    last += f" ({(curve[-1] - b[-1]) / b[-1]:+.2%})"
                    b_mean = sum(b[-10:]) / len(b[-10:])
                    tail += f" ({(mean - b_mean) / b_mean:+.2%})"
            print(f"| {variant} | {run['tokens']:,} | {ratio} | {run['mfu']} | {run['peak']} | "
                  f"{run['host']} | {len(curve)} | {last} | {tail} |")
    if failed:
        print("\nfailed (no throughput line): " + ", ".join(failed))


if __name__ == "__main__":
    main()
