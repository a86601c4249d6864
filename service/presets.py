"""Model presets: named transformer shapes that a spec can refer to by `model.preset`."""

from __future__ import annotations

PRESETS: dict[str, dict[str, int | str]] = {
    # For tests and the demo: trains in seconds on two CPU ranks.
    "gpt-tiny": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    # GPT-3 family (Brown et al. 2020, Table 2.1), vocab 50257, context 2048.
    "gpt3-125m": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq_len": 2048},
    "gpt3-350m": {"layers": 24, "hidden": 1024, "heads": 16, "vocab": 50257, "seq_len": 2048},
    "gpt3-1.3b": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257, "seq_len": 2048},
    "gpt3-2.7b": {"layers": 32, "hidden": 2560, "heads": 32, "vocab": 50257, "seq_len": 2048},
    "gpt3-6.7b": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 50257, "seq_len": 2048},
    "gpt3-13b": {"layers": 40, "hidden": 5120, "heads": 40, "vocab": 50257, "seq_len": 2048},
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 50257, "seq_len": 2048},
}
