"""Records kept for the operator to collect (collect.py): read from the last acknowledged position, reclaimed
only once acknowledged, and a line the runtime did not write (someone with the pod's volume) never forwarded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tally_runtime.collect import Collection, parse_position
from tally_runtime.spool import _name


class Counts:
    def __init__(self) -> None:
        self.refused = self.collected = self.lost = 0


def collection(directory: Path, counts: Counts) -> Collection:
    def add(field: str):  # type: ignore[no-untyped-def]
        return lambda n=1: setattr(counts, field, getattr(counts, field) + n)

    return Collection(directory, 1 << 20, on_lost=add("lost"), on_refused=add("refused"),
                      on_collected=add("collected"))


def event(i: int) -> bytes:
    return json.dumps({"id": f"r{i}", "data": {"prompt_tokens": 3}}).encode() + b"\n"


async def test_records_are_read_again_until_acknowledged_and_then_reclaimed(tmp_path: Path) -> None:
    counts = Counts()
    kept = collection(tmp_path / "spool", counts)
    for i in range(10):
        kept.append(event(i))
    first = kept.read(4)
    assert [r["event"]["id"] for r in first["records"]] == ["r0", "r1", "r2", "r3"]
    assert kept.read(4)["records"] == first["records"]  # nothing moves until acknowledged
    assert kept.acknowledge(parse_position(first["through"])) == 4 and counts.collected == 4
    rest = kept.read(100)
    assert [r["event"]["id"] for r in rest["records"]] == [f"r{i}" for i in range(4, 10)]
    assert all(r["verified"] for r in rest["records"])
    assert kept.acknowledge(parse_position(first["through"])) == 0  # the same acknowledgement again: nothing
    with pytest.raises(ValueError):
        kept.acknowledge(parse_position(first["from"]))  # behind what was acknowledged
    with pytest.raises(ValueError):
        kept.acknowledge((99, 0))  # not in the spool
    kept.acknowledge(parse_position(rest["through"]))
    assert kept.empty and kept.pending == 0 and await kept.flush(0.1)


async def test_a_line_the_runtime_did_not_write_is_refused_and_one_from_before_a_restart_is_marked(
        tmp_path: Path) -> None:
    counts = Counts()
    kept = collection(tmp_path / "spool", counts)
    kept.append(event(1))
    fd = os.open(tmp_path / "spool" / _name(kept.spool.tail), os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"0123456789abcdef0123456789abcdef " + event(666))  # a forged record, a MAC that is no MAC
    os.close(fd)
    kept.spool.sizes[kept.spool.tail] = (tmp_path / "spool" / _name(kept.spool.tail)).stat().st_size
    kept.append(event(2))
    read = kept.read(100)
    assert [r["event"]["id"] for r in read["records"]] == ["r1", "r2"] and read["refused"] == 1
    kept.acknowledge(parse_position(read["through"]))
    assert (counts.refused, counts.collected) == (1, 2)
    kept.append(event(3))
    await kept.close()
    again = collection(tmp_path / "spool", counts)  # a restart: a new key
    read = again.read(100)
    assert [(r["event"]["id"], r["verified"]) for r in read["records"]] == [("r3", False)]
    assert read["unverified"] == 1


async def test_a_page_of_records_is_parsed_and_checked_off_the_event_loop(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /internal/records?max=5000 parsed and checked every line on the event loop (0.1-0.2 s a call: four
    readers looping slowed /health from 0.07 s to 1 s). The lines are taken on the loop, the work is a thread's;
    the page is what `read` gives."""
    import threading

    counts = Counts()
    kept = collection(tmp_path / "spool", counts)
    for i in range(50):
        kept.append(event(i))
    threads: list[threading.Thread] = []
    page = Collection._page

    def recorded(self: Collection, *args: object) -> object:
        threads.append(threading.current_thread())
        return page(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Collection, "_page", recorded)
    got = await kept.page(20)
    assert threads and threads[0] is not threading.main_thread()
    assert got == kept.read(20) and len(got["records"]) == 20
