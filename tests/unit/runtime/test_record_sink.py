"""The usage-records sink on a failing disk: every record is written whole or counted lost, and a torn
record never swallows the next one (a short write used to leave a line that merged with the next record)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from tally_runtime import records
from tally_runtime.records import RecordSink, UsageRecord

REAL_WRITE = os.write  # `records.os` is `os`: the fake below is patched over it


def record(request_id: str) -> UsageRecord:
    return UsageRecord(id=request_id, time=1.7e9, model="m", endpoint="completions", tenant="t", tenant_source="key",
                       outcome="ok", finish_reasons=("length",), n=1, stream=False, prompt_tokens=3,
                       completion_tokens=5, cached_tokens=0, reasoning_tokens=0, derived=False,
                       time_to_first_token_seconds=0.1, duration_seconds=0.2)


def test_a_short_write_then_a_failure_tears_one_record_and_counts_it_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "records.jsonl"
    lost: list[str] = []
    sink = RecordSink(stdout=False, path=str(path), on_lost=lost.append)
    sink.write(record("cmpl-1"))
    calls = {"n": 0}

    def filling_disk(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return REAL_WRITE(fd, data[: len(data) // 2])  # a short write
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return REAL_WRITE(fd, data)  # the torn line's end, and later records

    monkeypatch.setattr(records.os, "write", filling_disk)
    sink.write(record("cmpl-2"))
    sink.write(record("cmpl-3"))
    sink.close()
    lines = path.read_bytes().split(b"\n")
    assert json.loads(lines[0])["id"] == "cmpl-1" and json.loads(lines[2])["id"] == "cmpl-3"
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[1])  # the torn one is one bad line of its own
    assert lost == ["file"] and sink.lost["file"] == 1


def test_a_short_write_that_then_succeeds_writes_the_whole_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "records.jsonl"
    sink = RecordSink(stdout=False, path=str(path))
    monkeypatch.setattr(records.os, "write", lambda fd, data: REAL_WRITE(fd, data[:7]))  # 7 bytes a call
    sink.write(record("cmpl-1"))
    sink.close()
    assert json.loads(path.read_bytes())["id"] == "cmpl-1" and not sink.lost


def test_records_name_the_service_a_meter_groups_by() -> None:
    """Namespace and service as fields of their own (added within v1), not only inside a CloudEvent's source."""
    import dataclasses
    import json

    named = dataclasses.replace(record("cmpl-1"), namespace="team-a", service="chat")
    body = json.loads(named.to_line())
    assert (body["schema"], body["namespace"], body["service"]) == ("tally.usage.v1", "team-a", "chat")
    event = json.loads(named.to_cloudevent("/namespaces/team-a/completionservices/chat/pods/p"))
    assert event["data"]["namespace"] == "team-a" and event["data"]["service"] == "chat"


def test_a_torn_record_whose_repair_also_fails_is_ended_before_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short write, then the disk full for the rest and for the repair newline too: the next record, once the
    disk has room, starts on a line of its own (it was merged into the torn one)."""
    path = tmp_path / "records.jsonl"
    sink = RecordSink(stdout=False, path=str(path))
    calls = {"n": 0}

    def full_then_free(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return REAL_WRITE(fd, data[:20])  # part of the record
        if calls["n"] in (2, 3):  # the rest of it, and the newline that would end it
            raise OSError(errno.ENOSPC, "No space left on device")
        return REAL_WRITE(fd, data)

    monkeypatch.setattr(records.os, "write", full_then_free)
    sink.write(record("cmpl-1"))
    sink.write(record("cmpl-2"))
    sink.close()
    first, second, end = path.read_bytes().split(b"\n")
    with pytest.raises(json.JSONDecodeError):
        json.loads(first)
    assert json.loads(second)["id"] == "cmpl-2" and end == b""
    assert sink.lost["file"] == 1
