"""The delivery spool (spool.py): what the receiver took is reclaimed as it goes, what it has not is bounded
(the oldest counted lost to make room), and every record is either delivered or counted lost, through a
receiver that fails, batches in flight while their segment is dropped, restarts and torn lines."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from tally_runtime.spool import Spool


def record(i: int, size: int = 100) -> bytes:
    return json.dumps({"id": f"r{i}", "pad": "x" * size}).encode() + b"\n"


def on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


class Books:
    def __init__(self) -> None:
        self.lost = 0

    def __call__(self, count: int) -> None:
        self.lost += count


def test_a_receiver_that_keeps_pace_loses_nothing_and_the_disk_holds_little(tmp_path: Path) -> None:
    """The whole file was reclaimed only once everything was delivered: at 20 records/s with a 200 ms receiver
    records were counted lost with 97 % of the spool delivered. Now a segment goes once delivered."""
    books = Books()
    spool = Spool(tmp_path / "spool", max_bytes=64 << 10, on_lost=books)
    delivered, biggest = 0, 0
    for i in range(20_000):  # 2.4 MB through a 64 KiB bound, never more than a few batches behind
        assert spool.append(record(i))
        while spool.pending > 7:  # the receiver keeps pace, a few records behind
            batch = spool.batch(7)
            assert batch is not None
            spool.delivered(batch)
            delivered += len(batch.lines)
        biggest = max(biggest, on_disk(tmp_path / "spool"))
    while (batch := spool.batch(500)) is not None:
        spool.delivered(batch)
        delivered += len(batch.lines)
    assert books.lost == 0 and delivered == 20_000 and spool.pending == 0 and spool.empty
    assert biggest <= (64 << 10) + spool.segment_bytes + 64


def test_at_the_bound_the_oldest_undelivered_are_counted_lost_and_the_newest_kept(tmp_path: Path) -> None:
    books = Books()
    spool = Spool(tmp_path / "spool", max_bytes=64 << 10, on_lost=books)
    for i in range(2_000):  # the receiver is down: 240 KB into a 64 KiB bound
        assert spool.append(record(i))
        assert spool.undelivered <= 64 << 10
    assert books.lost > 0 and spool.pending == 2_000 - books.lost
    ids = []
    while (batch := spool.batch(500)) is not None:
        ids += [json.loads(line)["id"] for line in batch.lines]
        spool.delivered(batch)
    assert ids == [f"r{i}" for i in range(books.lost, 2_000)]  # the oldest went, in order, none twice


def test_a_batch_in_flight_from_a_dropped_segment_is_counted_once(tmp_path: Path) -> None:
    for outcome in ("taken", "refused"):
        books = Books()
        spool = Spool(tmp_path / outcome, max_bytes=16 << 10, on_lost=books)
        for i in range(100):
            spool.append(record(i))
        batch = spool.batch(10)
        assert batch is not None and batch.segment == spool.head
        for i in range(100, 400):  # the bound drops the segment the batch came from
            spool.append(record(i))
        assert spool.head > batch.segment
        if outcome == "taken":
            spool.delivered(batch)
            sent = len(batch.lines)
        else:
            spool.failed(batch)
            sent = 0
        while (more := spool.batch(500)) is not None:
            spool.delivered(more)
            sent += len(more.lines)
        assert sent + books.lost == 400 and spool.pending == 0, outcome


def test_a_restart_resumes_from_the_cursor_and_a_torn_line_is_one_bad_line(tmp_path: Path) -> None:
    books = Books()
    directory = tmp_path / "spool"
    spool = Spool(directory, max_bytes=1 << 20, on_lost=books)
    for i in range(50):
        spool.append(record(i))
    batch = spool.batch(20)
    assert batch is not None
    spool.delivered(batch)
    assert spool.fd is not None
    os.write(spool.fd, b'{"id": "torn')  # a crash in the middle of a line
    spool.close()
    again = Spool(directory, max_bytes=1 << 20, on_lost=books)
    assert again.pending == 31  # 30 whole records and the torn one
    again.append(record(50))
    lines = []
    while (more := again.batch(500)) is not None:
        lines += more.lines
        again.delivered(more)
    assert [json.loads(line)["id"] for line in lines if line.endswith(b"}")] == [f"r{i}" for i in range(20, 51)]
    assert sum(not line.endswith(b"}") for line in lines) == 1


def test_an_earlier_runtimes_spool_file_is_taken_over_with_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "usage-records.spool"
    path.write_bytes(b"".join(record(i) for i in range(10)))
    (tmp_path / "usage-records.spool.offset").write_text(str(len(record(0)) * 4))
    spool = Spool(path, max_bytes=1 << 20)
    batch = spool.batch(500)
    assert batch is not None and [json.loads(line)["id"] for line in batch.lines] == [f"r{i}" for i in range(4, 10)]


def test_every_record_is_delivered_or_counted_lost_whatever_happens(tmp_path: Path) -> None:
    """Random appends, batches taken or refused, restarts, at a bound small enough to drop: the records delivered
    (at least once: a restart may send again what was taken but not yet marked) and those counted lost are all
    of them."""
    for seed in range(20):
        rng = random.Random(seed)
        books = Books()
        directory = tmp_path / f"s{seed}"
        spool = Spool(directory, max_bytes=8 << 10, on_lost=books)
        written, seen = 0, set()
        for _ in range(3_000):
            action = rng.random()
            if action < 0.55:
                if spool.append(record(written, rng.randint(10, 300))):
                    written += 1
                else:
                    written += 1  # counted lost by the spool
            elif action < 0.9:
                batch = spool.batch(rng.randint(1, 30))
                if batch is not None:
                    if rng.random() < 0.7:
                        seen.update(json.loads(line)["id"] for line in batch.lines)
                        spool.delivered(batch)
                    else:
                        spool.failed(batch)
            elif action < 0.93:
                spool.close()
                spool = Spool(directory, max_bytes=8 << 10, on_lost=books)
        while (batch := spool.batch(500)) is not None:
            seen.update(json.loads(line)["id"] for line in batch.lines)
            spool.delivered(batch)
        assert len(seen) + books.lost == written, (seed, len(seen), books.lost, written)


def test_the_oldest_undelivered_records_age_is_known(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    assert spool.oldest_age() == 0.0
    spool.append(record(0))
    spool.began[spool.head] -= 120  # as if it came two minutes ago
    assert 119 <= spool.oldest_age() <= 130
    batch = spool.batch(10)
    assert batch is not None
    spool.delivered(batch)
    assert spool.oldest_age() == 0.0
