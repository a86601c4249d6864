"""`workers.checkpoint.mapped.release`: the pages of a tag's mapped files that an export read
leave its resident set, their values still read back; a mapping with a page of its own (a
tensor written in place) is left as it is."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.checkpoint.mapped import release
from workers.monitor.proc_status import status_kib

MB = 1 << 20


def rss_file() -> int:
    return status_kib()["RssFile"] * 1024


def test_pages_read_from_a_mapped_tag_leave_the_resident_set(tmp_path: Path) -> None:
    tag = tmp_path / "step3"
    tag.mkdir()
    torch.save({"w": torch.arange(16 * MB // 4, dtype=torch.float32)}, tag / "states.pt")
    w = torch.load(tag / "states.pt", mmap=True, weights_only=True)["w"]
    before = rss_file()
    total = float(w.sum())  # every page read
    read = rss_file()
    assert read - before > 12 * MB
    assert release(str(tmp_path)) >= 16 * MB
    assert read - rss_file() > 12 * MB
    assert float(w.sum()) == total  # read again from the file's pages
    assert release(str(tmp_path / "elsewhere")) == 0


def test_a_mapping_written_to_is_not_released(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4 * MB // 4)}, tmp_path / "states.pt")
    w = torch.load(tmp_path / "states.pt", mmap=True, weights_only=True)["w"]
    w[:1024] = 7.0  # a private mapping's written page is the process's own
    assert release(str(tmp_path)) == 0
    assert float(w[:1024].sum()) == 7.0 * 1024
