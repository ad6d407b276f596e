"""``srl chaos``'s store-disk-full injector (``app.chaos.netns.FullDisk.fill``, issue 39): the
store's writers go on while it fills, so the space can shrink between ``statvfs`` and the
allocation; ENOSPC while filling is the disk full, not an injector that failed."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.chaos.netns import FullDisk

MB = 1024 * 1024


class Tmpfs:
    """``statvfs`` and ``posix_fallocate`` of a tmpfs with ``free`` bytes left of which
    ``statvfs`` says ``claimed`` (a writer took the rest since): a ``fallocate`` that does not
    fit fails with ENOSPC and takes nothing (a tmpfs gives back all of a failed one)."""

    def __init__(self, claimed: int, free: int) -> None:
        self.claimed, self.free = claimed, free
        self.taken: list[tuple[int, int]] = []

    def statvfs(self, _path: Any) -> Any:
        return SimpleNamespace(f_bavail=self.claimed // 4096, f_frsize=4096)

    def posix_fallocate(self, _fd: int, offset: int, length: int) -> None:
        if length > self.free:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.free -= length
        self.taken.append((offset, length))


@pytest.mark.parametrize("free", [0, 1000, 37 * MB + 5000, 100 * MB - 70 * 1024])
def test_enospc_while_filling_is_the_disk_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int
) -> None:
    disk = Tmpfs(claimed=100 * MB, free=free)
    monkeypatch.setattr(os, "statvfs", disk.statvfs)
    monkeypatch.setattr(os, "posix_fallocate", disk.posix_fallocate)
    taken = FullDisk(tmp_path, 128).fill()
    assert taken == sum(n for _o, n in disk.taken) == free - disk.free
    assert disk.free < 2 * FullDisk.MIN_PIECE  # full: the next write of a few KB fails
    assert [o for o, _n in disk.taken] == [
        sum(n for _o, n in disk.taken[:i]) for i in range(len(disk.taken))
    ]


def test_without_contention_all_but_leave_bytes_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Tmpfs(claimed=100 * MB, free=100 * MB)
    monkeypatch.setattr(os, "statvfs", disk.statvfs)
    monkeypatch.setattr(os, "posix_fallocate", disk.posix_fallocate)
    assert FullDisk(tmp_path, 128).fill(leave_bytes=64 * 1024) == 100 * MB - 64 * 1024
    assert disk.free == 64 * 1024


def test_another_error_while_filling_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(_fd: int, _offset: int, _length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    with pytest.raises(OSError, match="Input/output"):
        FullDisk(tmp_path, 128).fill()


def test_a_real_tmpfs_that_has_less_than_statvfs_said_is_filled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real tmpfs (root only): ``statvfs`` answered before a writer took 3 MB of 8."""
    why = FullDisk.unavailable(tmp_path)
    if why is not None:
        pytest.skip(why)
    disk = FullDisk(tmp_path / "store", 8).mount()
    try:
        st = os.statvfs(disk.path)
        monkeypatch.setattr(os, "statvfs", lambda _path: st)
        (disk.path / "checkpoint").write_bytes(bytes(3 * MB))  # after statvfs, before fill
        assert disk.fill() > 4 * MB
        with pytest.raises(OSError, match="No space left"):
            (disk.path / "x").write_bytes(bytes(64 * 1024))
        disk.free()
        (disk.path / "x").write_bytes(bytes(MB))
    finally:
        disk.unmount()
