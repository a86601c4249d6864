"""A safetensors file written tensor by tensor from the tensors' own memory.

`safetensors.torch.save_file` copies a whole file's tensors into bytes first: a second copy of
the weights in memory, where the export's tensors are views of the tag's files, mapped, not
copies. Called by `workers.checkpoint.hf_weights.write_hf`.
"""

from __future__ import annotations

import json

import torch

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str,
                      metadata: dict[str, str]) -> None:
    """The safetensors file of `tensors` (its format: an 8-byte little-endian header length,
    the JSON header padded with spaces to 8 bytes, each tensor's bytes in header order),
    written tensor by tensor from the tensors' own memory."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
