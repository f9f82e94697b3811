"""The counter journal: it round-trips, the series continue from it, a torn write falls back to the slot
before it, anything untrusted starts a new epoch without crashing, and a journal that cannot be written
is removed rather than left to lag."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest

from tally_runtime.engine.base import Delta, FinishReason
from tally_runtime.ledger import Journal, Totals, encode_slot
from tally_runtime.metrics import Metrics
from tally_runtime.usage import ChoiceUsage, request_usage


def finished(index: int, prompt_index: int, deltas: list[Delta], prompt_len: int = 99) -> ChoiceUsage:
    usage = ChoiceUsage(index, prompt_index, prompt_len)
    for delta in deltas:
        usage.observe(delta)
    return usage


def series(metrics: Any) -> dict[str, float]:
    """Every sample except the `_created` timestamps prometheus_client adds to counters."""
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(metrics.registry).decode()
    return {f"{s.name}{sorted(s.labels.items())}" if s.labels else s.name: s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_the_journal_round_trips_and_the_series_continue_from_it(tmp_path: Path) -> None:
    first = Metrics()
    first.record_request("completions", "ok", "length")
    first.record_usage(request_usage([finished(0, 0, [Delta(token_ids=(1, 2), prompt_tokens=4, completion_tokens=2,
                                                            cached_tokens=1, finish_reason=FinishReason.LENGTH)])]))
    first.record_tenant("team-a", None)
    journal = Journal(tmp_path / "usage.json")
    journal.write(first.totals)
    resumed = Journal(tmp_path / "usage.json").load()
    assert resumed == first.totals
    second = Metrics(totals=resumed)
    assert series(second) == series(first) and series(first)["tally_completion_tokens_total"] == 2


def test_writes_alternate_and_a_torn_write_falls_back_to_the_slot_before(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "usage.json")
    older = Totals(epoch=5.0, prompt_tokens=10.0, tenants={f"tenant-{i}": [1.0, 2.0, 3.0, 0.0] for i in range(300)})
    newer = Totals(epoch=5.0, prompt_tokens=11.0, tenants=older.tenants)
    journal.write(older)
    journal.write(newer)
    journal.close()
    slots = sorted(tmp_path.iterdir())
    assert [p.name for p in slots] == ["usage.json", "usage.json.1"]
    assert Journal(tmp_path / "usage.json").load() == newer
    newest = tmp_path / "usage.json.1"  # sequence 2 went to the second slot; tear it as SIGKILL mid-pwrite would
    raw = newest.read_bytes()
    assert len(raw) > 8192  # several pages: a write this size can be torn
    newest.write_bytes(raw[:4096])
    assert Journal(tmp_path / "usage.json").load() == older


def test_a_restarted_process_continues_the_sequence(tmp_path: Path) -> None:
    Journal(tmp_path / "usage.json").write(Totals(epoch=1.0, prompt_tokens=3.0))
    Journal(tmp_path / "usage.json").write(Totals(epoch=1.0, prompt_tokens=4.0))  # without an explicit load
    assert Journal(tmp_path / "usage.json").load() == Totals(epoch=1.0, prompt_tokens=4.0)


def valid(**changes: Any) -> bytes:
    snapshot = orjson.loads(Totals(epoch=7.0).to_json())
    snapshot.update(changes)
    payload = orjson.dumps(snapshot)
    import zlib

    return b"tally-journal 2 1 %d %08x\n" % (len(payload), zlib.crc32(payload)) + payload


@pytest.mark.parametrize("raw", [
    pytest.param(b"null", id="null"),
    pytest.param(b'{"version":1,"requests":{"no-bars":1}}', id="old-format"),
    pytest.param(b"tally-journal 2 1 4 00000000\nnull", id="bad-checksum"),
    pytest.param(valid(requests={"no-bars": 1}), id="request-key-without-labels"),
    pytest.param(valid(prompt_tokens=-1), id="negative"),
    pytest.param(valid(prompt_tokens=1e999), id="infinite"),
    pytest.param(valid(tenants={"a": [1, 2]}), id="tenant-short"),
    pytest.param(valid(tenants=[1]), id="tenants-not-an-object"),
    pytest.param(valid(epoch=0), id="no-epoch"),
    pytest.param(valid(extra=1), id="unknown-field"),
    pytest.param(b"tally-journal 2 1 999999999 0\n{}", id="length-beyond-the-file"),
    pytest.param(b"\xff\xfe garbage", id="garbage"),
])
def test_an_untrusted_journal_starts_a_new_epoch_and_never_crashes(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / "usage.json").write_bytes(raw)
    assert Journal(tmp_path / "usage.json").load() is None


def test_the_hostile_fixtures_are_refused_for_their_content_not_their_framing(tmp_path: Path) -> None:
    (tmp_path / "usage.json").write_bytes(valid())  # the same framing, honest content: read back
    assert Journal(tmp_path / "usage.json").load() == Totals(epoch=7.0)


def test_a_journal_that_cannot_be_written_is_removed_and_says_so(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "usage.json")
    journal.write(Totals(epoch=3.0, prompt_tokens=1.0))
    journal.write(Totals(epoch=3.0, prompt_tokens=2.0))
    journal.close()
    (tmp_path / "usage.json").unlink()
    os.symlink("/dev/full", tmp_path / "usage.json")  # the next write (sequence 3, first slot) gets ENOSPC
    journal.write(Totals(epoch=3.0, prompt_tokens=3.0))
    assert not journal.healthy
    assert not (tmp_path / "usage.json").exists() and not (tmp_path / "usage.json.1").exists()
    assert Journal(tmp_path / "usage.json").load() is None  # a restart begins a new epoch, never lags
    journal.write(Totals(epoch=3.0, prompt_tokens=4.0))  # the disk has room again
    assert journal.healthy and Journal(tmp_path / "usage.json").load() == Totals(epoch=3.0, prompt_tokens=4.0)


def test_slots_are_created_private(tmp_path: Path) -> None:
    Journal(tmp_path / "usage.json").write(Totals())
    assert (tmp_path / "usage.json").stat().st_mode & 0o777 == 0o600
    assert encode_slot(1, Totals(epoch=1.0)).startswith(b"tally-journal 2 1 ")
