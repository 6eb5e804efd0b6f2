#!/usr/bin/env python3
"""The GPUs' clocks, power and temperature during each run of a bench, from nvidia-smi samples.

    python3 tools/gpu/smi_windows.py SMI_CSV WINDOWS

SMI_CSV: `nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 250` output. WINDOWS: lines
"NAME start|end EPOCH_SECONDS" written around each run. Prints, per run and GPU, the median SM
clock (MHz), power (W) and temperature (C) over the run's busy samples (power above a third of the
run's highest), and the clock-event reasons seen in those samples other than idle (0x1): a run
whose clock sits below the others' or names a power or thermal reason (0x4, 0x20, 0x40) ran on a
slowed card, which its tokens/s alone cannot tell.
"""
import collections
import datetime
import statistics
import sys


def samples(path):
    for line in open(path, errors="replace"):
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 6:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            yield when, int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), parts[5]
        except ValueError:
            continue


def windows(path):
    starts, spans = {}, []
    for line in open(path):
        name, edge, when = line.split()
        if edge == "start":
            starts[name] = float(when)
        elif name in starts:
            spans.append((name, starts.pop(name), float(when)))
    return spans


def main() -> None:
    rows = list(samples(sys.argv[1]))
    print("| run | GPU | busy samples | SM MHz | power W | temp C | reasons |")
    print("|---|---|---|---|---|---|---|")
    for name, start, end in windows(sys.argv[2]):
        per_gpu = collections.defaultdict(list)
        for when, gpu, clock, power, temp, reasons in rows:
            if start <= when <= end:
                per_gpu[gpu].append((clock, power, temp, reasons))
        for gpu, got in sorted(per_gpu.items()):
            top = max(power for _, power, _, _ in got)
            busy = [row for row in got if row[1] > top / 3]
            reasons = sorted({r for _, _, _, r in busy if r not in ("0x0000000000000000",
                                                                       "0x0000000000000001")})
            print(f"| {name} | {gpu} | {len(busy)} | {statistics.median(r[0] for r in busy):.0f} | "
                  f"{statistics.median(r[1] for r in busy):.0f} | "
                  f"{statistics.median(r[2] for r in busy):.0f} | {' '.join(reasons) or '-'} |")


if __name__ == "__main__":
    main()
