"""The journal's invariant under injected faults: a resumed epoch is never behind what was exported under it.

A process starts from the journal (`Journal.resume`), then records requests one by one; after each
recorded request its counters are what /metrics exports, whether or not the journal write worked. A fault
(a short write, ENOSPC, EROFS that also refuses the unlink and lasts across the restart) is injected at
each write of the sequence in turn, then the process crashes and a new one resumes. Whatever it resumes
under the first process's epoch must be at least every value exported under it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tally_runtime import ledger
from tally_runtime.ledger import Journal

WRITES = 6  # the start-up write, then five recorded requests
REAL_PWRITE, REAL_OPEN, REAL_UNLINK = os.pwrite, os.open, Path.unlink  # `ledger.os` is `os`: patched below


class Faults:
    """os.pwrite/os.open/os.unlink of the ledger module, failing as the named fault from write `at` on."""

    def __init__(self, kind: str, at: int) -> None:
        self.kind, self.at, self.writes = kind, at, 0
        self.lasting = False  # EROFS: the volume stays read-only, also for the next process

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        self.writes += 1
        if self.lasting or self.writes == self.at:
            if self.kind == "short":
                return REAL_PWRITE(fd, data[: len(data) // 2], offset)  # a filling volume: a torn slot
            if self.kind == "erofs":
                self.lasting = True
                raise OSError(errno.EROFS, "Read-only file system")
            raise OSError(errno.ENOSPC, "No space left on device")
        return REAL_PWRITE(fd, data, offset)

    def open(self, path: str | Path, flags: int, mode: int = 0o777) -> int:
        if self.lasting and flags & os.O_WRONLY:
            raise OSError(errno.EROFS, "Read-only file system")
        return REAL_OPEN(path, flags, mode)

    def unlink(self, path: Path, missing_ok: bool = False) -> None:
        if self.lasting:
            raise OSError(errno.EROFS, "Read-only file system")
        REAL_UNLINK(path, missing_ok=missing_ok)


def run_process(path: Path) -> tuple[float, list[float]]:
    """One process: resume, then record five requests of 10 tokens; its epoch and what it exported."""
    journal = Journal(path)
    totals = journal.resume()
    exported = [totals.completion_tokens]
    for _ in range(WRITES - 1):
        totals.completion_tokens += 10
        journal.write(totals)
        exported.append(totals.completion_tokens)
    return totals.epoch, exported  # and then it crashes: nothing is closed or flushed


@pytest.mark.parametrize("kind", ["short", "enospc", "erofs"])
@pytest.mark.parametrize("at", range(1, WRITES + 1))
def test_a_resumed_epoch_is_never_behind_what_was_exported_under_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, at: int) -> None:
    path = tmp_path / "usage.json"
    first_epoch, first_exported = run_process(path)  # a healthy history to resume from
    faults = Faults(kind, at)
    monkeypatch.setattr(ledger.os, "pwrite", faults.pwrite)
    monkeypatch.setattr(ledger.os, "open", faults.open)
    monkeypatch.setattr(Path, "unlink", lambda path, missing_ok=False: faults.unlink(path, missing_ok))
    epoch, exported = run_process(path)
    restarted = Journal(path).resume()
    history = {first_epoch: max(first_exported)}
    history[epoch] = max(history.get(epoch, 0.0), *exported)
    if restarted.epoch in history:
        assert restarted.completion_tokens >= history[restarted.epoch], (kind, at, restarted)


def test_a_short_write_is_a_failed_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = Journal(tmp_path / "usage.json")
    journal.resume()
    monkeypatch.setattr(ledger.os, "pwrite", Faults("short", 1).pwrite)
    totals = ledger.Totals(completion_tokens=10)
    journal.write(totals)
    assert not journal.healthy
