#!/usr/bin/env python3
"""The Python counterpart of bench/safetensors_load_bench: safetensors.numpy.load_file over the
same file, with the same figures (seconds, GB/s of tensor data, peak RSS from getrusage).

    $D9D_PYTHON bench/safetensors_load_bench.py /tmp/big.safetensors [--cold]

numpy, not torch: the tools environment ($D9D_PYTHON) has safetensors and numpy, and the torch
environment has torch without the safetensors package. load_file maps the file and copies each
tensor into a numpy array, as safetensors.torch.load_file does into torch tensors.
"""
import os
import resource
import sys
import time

from safetensors.numpy import load_file


def main():
    path = sys.argv[1]
    if "--cold" in sys.argv[2:]:
        fd = os.open(path, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    start = time.perf_counter()
    tensors = load_file(path)
    seconds = time.perf_counter() - start
    nbytes = sum(t.nbytes for t in tensors.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    mode = "cold" if "--cold" in sys.argv[2:] else "warm"
    print(f"python load_file {mode}: {len(tensors)} tensors, {nbytes / 1e9:.3f} GB in {seconds:.3f} s"
          f" = {nbytes / 1e9 / seconds:.2f} GB/s, peak RSS {peak:.2f} GB")


if __name__ == "__main__":
    main()
