"""The independent side of d9d's safetensors tests: the Python `safetensors` package (and numpy).

    safetensors_check.py read FILE         # {"tensors": {name: {dtype, shape, values, hex}},
                                           #  "metadata": {...}, "order": [names in data order]}
    safetensors_check.py write FILE        # writes the reference tensors (every dtype)
    safetensors_check.py read-sharded DIR  # reads DIR/model.safetensors.index.json and every shard:
                                           # {"index": ..., "shards": {file: <read of that file>}}

numpy has no bfloat16 or float8: those tensors are read as raw bytes (safetensors.deserialize);
BF16 is widened to float32 by hand for "values", float8 has only "hex". Every other dtype goes
through safetensors.numpy.load_file (or safe_open when the file also holds a numpy-less dtype).
"hex" is always the tensor's bytes as the package sees them.
"""
import json
import os
import sys

import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import load_file

NUMPYLESS = {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}


def bf16_bits(values):
    """float32 values exactly representable in bfloat16 -> their bf16 bit patterns."""
    bits = np.asarray(values, dtype="<f4").view("<u4")
    assert np.all(bits & 0xFFFF == 0), "not exactly representable in bfloat16"
    return (bits >> 16).astype("<u2")


def reference():
    """name -> (safetensors dtype, numpy array of the stored values or bits)."""
    return {
        "f32": ("F32", np.arange(6, dtype="<f4").reshape(2, 3) - 2.5),
        "f64": ("F64", np.arange(4, dtype="<f8") * 0.125),
        "f16": ("F16", (np.arange(6, dtype="<f2") * 0.25).reshape(3, 2)),
        "bf16": ("BF16", bf16_bits([1.0, -2.0, 0.5, 3.0]).reshape(2, 2)),
        "i64": ("I64", np.array([-3, 2**40, 7], dtype="<i8")),
        "i32": ("I32", np.array([[-1, 2], [3, -4]], dtype="<i4")),
        "i16": ("I16", np.array([-300, 300], dtype="<i2")),
        "i8": ("I8", np.array([-128, 127, 0], dtype="i1")),
        "u8": ("U8", np.array([0, 255, 17], dtype="u1")),
        "bool": ("BOOL", np.array([True, False, True])),
        "f8_e4m3": ("F8_E4M3", np.array([0x38, 0xC0, 0x00, 0x7E], dtype="u1").reshape(2, 2)),
        "f8_e5m2": ("F8_E5M2", np.array([0x3C, 0xC0, 0x7B], dtype="u1")),
        "f8_e8m0": ("F8_E8M0", np.array([0x7F, 0x80, 0x00], dtype="u1")),
        "u16": ("U16", np.array([0, 65535, 300], dtype="<u2")),
        "u32": ("U32", np.array([0, 2**32 - 1, 70000], dtype="<u4")),
        "u64": ("U64", np.array([0, 2**64 - 1, 2**40], dtype="<u8")),
        "c64": ("C64", np.array([1 - 2j, 0.5 + 3j], dtype="<c8")),
        "scalar": ("F32", np.array(42.0, dtype="<f4")),
        "empty": ("F32", np.zeros((0, 3), dtype="<f4")),
    }


# safetensors.serialize_file names dtypes as the frameworks do.
SERIALIZE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                   "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                   "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                   "F8_E8M0": "float8_e8m0fnu", "U16": "uint16", "U32": "uint32",
                   "U64": "uint64", "C64": "complex64"}


def write(path):
    metadata = {"format": "pt", "step": "12"}
    tensors = {
        name: {"dtype": SERIALIZE_NAMES[dtype], "shape": list(array.shape),
               "data": array.tobytes()}
        for name, (dtype, array) in reference().items()
    }
    try:
        safetensors.serialize_file(tensors, path, metadata=metadata)  # safetensors < 0.8
    except TypeError:
        # safetensors >= 0.8 takes TensorSpec(dtype, shape, data_ptr, data_len); the buffers
        # must stay alive during the call.
        buffers = {name: np.ascontiguousarray(array) for name, (_, array) in reference().items()}
        specs = {
            name: safetensors.TensorSpec(dtype=SERIALIZE_NAMES[dtype], shape=list(array.shape),
                                         data_ptr=buffers[name].ctypes.data,
                                         data_len=buffers[name].nbytes)
            for name, (dtype, array) in reference().items()
        }
        safetensors.serialize_file(specs, path, metadata=metadata)


def values_of(array):
    if np.iscomplexobj(array):
        return [[v.real.item(), v.imag.item()] for v in array.reshape(-1)]
    return [v.item() for v in array.reshape(-1)]


def read_file(path):
    with open(path, "rb") as f:
        raw = {name: info for name, info in safetensors.deserialize(f.read())}
    plain = load_file(path) if all(i["dtype"] not in NUMPYLESS for i in raw.values()) else None
    out = {}
    for name, info in raw.items():
        data = bytes(info["data"])
        if info["dtype"] == "BF16":
            bits = np.frombuffer(data, dtype="<u2").astype("<u4") << 16
            values = values_of(bits.view("<f4"))
        elif info["dtype"] in NUMPYLESS:
            values = None
        else:
            if plain is None:  # load_file refuses the whole file when one tensor is numpy-less
                with safe_open(path, framework="numpy") as f:
                    array = f.get_tensor(name)
            else:
                array = plain[name]
            assert list(array.shape) == list(info["shape"]), name
            values = values_of(array)
        out[name] = {"dtype": info["dtype"], "shape": list(info["shape"]), "values": values,
                     "hex": data.hex()}
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
    # The header's order of keys is not the data order; recover that from the offsets.
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    order = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: tuple(header[k]["data_offsets"]))
    return {"tensors": out, "metadata": metadata, "order": order}


def read(path):
    print(json.dumps(read_file(path)))


def read_sharded(directory):
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = {name: read_file(os.path.join(directory, name))
              for name in sorted(set(index["weight_map"].values()))}
    print(json.dumps({"index": index, "shards": shards}))


if __name__ == "__main__":
    {"read": read, "write": write, "read-sharded": read_sharded}[sys.argv[1]](sys.argv[2])
