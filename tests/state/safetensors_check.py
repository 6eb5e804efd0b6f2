"""The independent side of d9d's safetensors tests: the Python `safetensors` package (and numpy).

    safetensors_check.py read FILE    # prints {"tensors": {name: {dtype, shape, values}}, "metadata"}
    safetensors_check.py write FILE   # writes the reference tensors (every dtype, BF16 included)

numpy has no bfloat16, so BF16 tensors are read as raw bytes (safetensors.deserialize) and widened
to float32 by hand; every other dtype goes through safetensors.numpy.load_file.
"""
import json
import sys

import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import load_file


def bf16_bits(values):
    """float32 values exactly representable in bfloat16 -> their bf16 bit patterns."""
    bits = np.asarray(values, dtype="<f4").view("<u4")
    assert np.all(bits & 0xFFFF == 0), "not exactly representable in bfloat16"
    return (bits >> 16).astype("<u2")


def reference():
    """name -> (safetensors dtype, numpy array of the stored values, shape)."""
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
        "scalar": ("F32", np.array(42.0, dtype="<f4")),
        "empty": ("F32", np.zeros((0, 3), dtype="<f4")),
    }


# safetensors.serialize_file names dtypes as the frameworks do.
SERIALIZE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                   "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                   "BOOL": "bool"}


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


def read(path):
    with open(path, "rb") as f:
        raw = {name: info for name, info in safetensors.deserialize(f.read())}
    plain = load_file(path) if all(i["dtype"] != "BF16" for i in raw.values()) else None
    out = {}
    for name, info in raw.items():
        if info["dtype"] == "BF16":
            bits = np.frombuffer(bytes(info["data"]), dtype="<u2").astype("<u4") << 16
            array = bits.view("<f4").reshape(info["shape"])
            numpy_dtype = "bfloat16-as-float32"
        else:
            if plain is None:  # load_file refuses the whole file when one tensor is BF16
                with safe_open(path, framework="numpy") as f:
                    array = f.get_tensor(name)
            else:
                array = plain[name]
            numpy_dtype = str(array.dtype)
        out[name] = {
            "dtype": info["dtype"],
            "numpy_dtype": numpy_dtype,
            "shape": list(array.shape),
            "values": [v.item() for v in array.reshape(-1)],
        }
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
    print(json.dumps({"tensors": out, "metadata": metadata}))


if __name__ == "__main__":
    {"read": read, "write": write}[sys.argv[1]](sys.argv[2])
