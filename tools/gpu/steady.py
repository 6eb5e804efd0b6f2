"""A run's steady-state rate: the median of the per-step train/tokens_per_second over the second
half of the steps in a metrics.jsonl (the trainer's own throughput averages every step after the
first, which counts CUDA-graph capture and warm-up steps). Prints one line, or nothing when the
file has no such metric."""
import json
import statistics
import sys


def main():
    rates = []
    try:
        with open(sys.argv[1]) as lines:
            for line in lines:
                row = json.loads(line)
                if "train/tokens_per_second" in row:
                    rates.append((row["step"], row["train/tokens_per_second"]))
    except OSError:
        return
    if len(rates) < 4:
        return
    half = rates[len(rates) // 2:]
    median = statistics.median(rate for _, rate in half)
    print(f"steady: {median:.0f} tokens/s (median of steps {half[0][0]}-{half[-1][0]})")


if __name__ == "__main__":
    main()
