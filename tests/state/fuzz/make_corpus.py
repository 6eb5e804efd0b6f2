"""Writes the seed corpus of the safetensors fuzz target (tests/state/fuzz/corpus/).

    python3 tests/state/fuzz/make_corpus.py tests/state/fuzz/corpus

valid_*: files the reader must accept (every dtype, metadata, scalars, empty tensors, a header
not padded to 8, entries listed out of data order). bad_*: one malformed file per check of the
reader, which must refuse it with std::runtime_error. Standard library only, so the bytes do not
depend on a writer under test.
"""
import json
import os
import struct
import sys


def file_bytes(header, data=b"", length=None, raw_header=None):
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
         "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8,
         "C64": 8}


def all_dtypes():
    header, data = {"__metadata__": {"format": "pt", "step": "3"}}, b""
    for i, (dtype, size) in enumerate(SIZES.items()):
        shape = [2, 3] if i % 2 else [5]
        count = shape[0] * (shape[1] if len(shape) > 1 else 1)
        values = bytes((i * 7 + k) % 2 if dtype == "BOOL" else (i * 31 + k * 13) % 251
                       for k in range(count * size))
        header[dtype.lower()] = entry(dtype, shape, len(data), len(data) + len(values))
        data += values
    return file_bytes(header, data)


def main(out):
    os.makedirs(out, exist_ok=True)
    f32x2 = entry("F32", [2], 0, 8)
    eight = bytes(range(8))
    seeds = {
        "valid_all_dtypes": all_dtypes(),
        "valid_empty": file_bytes({}),
        "valid_metadata_only": file_bytes({"__metadata__": {"a": "b", "": "\u00e9\u4e2d"}}),
        "valid_scalar_and_empty": file_bytes({"s": entry("F64", [], 0, 8),
                                              "e": entry("F32", [0, 4], 8, 8),
                                              "z": entry("I8", [3, 0, 2], 8, 8)}, bytes(8)),
        "valid_out_of_order": file_bytes({"b": entry("U8", [3], 5, 8), "a": entry("U8", [5], 0, 5)},
                                         b"abcdefgh"),
        "valid_unpadded_misaligned": file_bytes({"u": entry("U8", [1], 0, 1),
                                                 "w": entry("F32", [2], 1, 9)}, bytes(9)),
        "valid_padded_spaces": file_bytes(None, eight, raw_header=b'{"w":' + json.dumps(
            f32x2).encode() + b"}   \n\t  "),
        "valid_unicode_name": file_bytes({"\u0394.w\u00e9ight": f32x2}, eight),
        "bad_short": b"\x08\x00\x00",
        "bad_length_past_end": file_bytes({}, length=1000),
        "bad_length_huge": file_bytes({}, length=2**64 - 1),
        "bad_json": file_bytes(None, raw_header=b'{"w": {"dtype": '),
        "bad_not_object": file_bytes([1, 2]),
        "bad_duplicate": file_bytes(None, eight, raw_header=(
            b'{"w":' + json.dumps(f32x2).encode() + b',"w":' + json.dumps(f32x2).encode() + b"}")),
        "bad_duplicate_field": file_bytes(None, eight, raw_header=(
            b'{"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}')),
        "bad_deep": file_bytes(None, raw_header=b'{"w":{"shape":[[[[[1]]]]]}}'),
        "bad_utf8_name": file_bytes(None, eight, raw_header=(
            b'{"w\xff":' + json.dumps(f32x2).encode() + b"}")),
        "bad_utf8_surrogate": file_bytes(None, eight, raw_header=(
            b'{"w\xed\xa0\x80":' + json.dumps(f32x2).encode() + b"}")),
        "bad_dtype": file_bytes({"w": entry("F128", [1], 0, 8)}, eight),
        "bad_dtype_sub_byte": file_bytes({"w": entry("F4", [16], 0, 8)}, eight),
        "bad_shape_negative": file_bytes({"w": entry("F32", [-2], 0, 8)}, eight),
        "bad_shape_float": file_bytes({"w": entry("F32", [2.0], 0, 8)}, eight),
        "bad_shape_overflow": file_bytes({"w": entry("F32", [2**62, 8], 0, 8)}, eight),
        "bad_shape_zero_overflow": file_bytes({"w": entry("U8", [0, 2**40, 2**40], 0, 0)}),
        "bad_size_mismatch": file_bytes({"w": entry("F32", [3], 0, 8)}, eight),
        "bad_offsets_range": file_bytes({"w": entry("F32", [2], 0, 100)}, eight),
        "bad_offsets_reversed": file_bytes({"w": entry("F32", [2], 8, 0)}, eight),
        "bad_offsets_negative": file_bytes({"w": entry("F32", [2], -8, 0)}, eight),
        "bad_overlap": file_bytes({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)},
                                  bytes(12)),
        "bad_hole": file_bytes({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)},
                               bytes(12)),
        "bad_trailing": file_bytes({"w": f32x2}, eight + b"xx"),
        "bad_bool": file_bytes({"w": entry("BOOL", [2], 0, 2)}, b"\x01\x02"),
        "bad_metadata_value": file_bytes({"__metadata__": {"step": 12}}),
        "bad_metadata_type": file_bytes({"__metadata__": ["a"]}),
        "bad_entry_type": file_bytes({"w": [1]}),
        "bad_missing_field": file_bytes({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, eight),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} seeds to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
