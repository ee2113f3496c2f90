"""Supervising a distributed job (rlflow.engine.backend.supervise), its pure parts on literal text:
rank prefixes, torchrun's failure summary, failure records and which rank is blamed. Real jobs under
torchrun and DeepSpeed's launcher: tests/unit/engine/backend/test_launch.py."""

import json
import os
import signal
import socket

import pytest

from rlflow.engine.backend.supervise import (
    FAILURE_DIR_ENV,
    _job_failure,
    _JobLog,
    _read_failure_records,
    record_failures,
    split_rank_prefix,
)

# torchrun's summary when rank 1 died with exit code 7 and rank 0 then got its SIGTERM
TORCHRUN_SUMMARY = """\
============================================================
echo_ranks.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-01-01_00:00:01
  host      : node0
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 101)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 101
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : node0
  rank      : 1 (local_rank: 1)
  exitcode  : 7 (pid: 102)
  error_file: <N/A>
============================================================"""


def job_log(*lines: str) -> _JobLog:
    """The log the supervisor builds from these output lines."""
    log = _JobLog()
    for line in lines:
        log.add(*split_rank_prefix(line))
    return log


def record(rank: int, error: str, time_ns: int = 1, exit_code: int = 1) -> dict:
    traceback = f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{error}\n"
    return {"rank": rank, "time_ns": time_ns, "exit_code": exit_code, "host": "node0", "error": error,
            "traceback": traceback}  # fmt: skip


def test_rank_prefixes_are_split():
    assert split_rank_prefix("[rank3]:hello") == (3, "hello")
    assert split_rank_prefix("[rank3]:[rank3]: Traceback") == (3, "Traceback")  # torch.distributed's own prefix
    assert split_rank_prefix("[rank3]:[rank1]: x") == (3, "[rank1]: x")
    assert split_rank_prefix("W1129 torchrun says") == (None, "W1129 torchrun says")


def test_torchruns_summary_gives_each_failed_rank_its_exit_code_and_the_root_cause():
    log = job_log("[rank0]:hello", "[rank1]:hello", *TORCHRUN_SUMMARY.splitlines())
    assert log.summary_failures == {0: -15, 1: 7} and log.summary_root == 1
    assert {rank: list(lines) for rank, lines in log.lines.items() if rank is not None} == {0: ["hello"], 1: ["hello"]}
    assert log.first_traceback_rank is None


def test_a_rank_that_died_without_a_record_is_blamed_before_the_peers_that_recorded_errors():
    log = job_log("[rank1]:loading", *TORCHRUN_SUMMARY.splitlines())
    peer = record(0, "RuntimeError: Connection closed by peer")  # rank 0 failed because rank 1 vanished
    error = _job_failure(1, log, [peer])
    assert (error.rank, error.exit_code) == (1, 7)
    assert str(error).splitlines()[0] == (
        "distributed job failed: rank 1 exited with code 7 (died without a Python exception: killed, out of memory,"
        " or os._exit); its last log lines:"
    )
    assert error.tail == ["loading"]


def test_the_earliest_failure_record_names_the_rank_its_code_and_its_error():
    log = job_log("[rank0]:x", "[rank1]:y", "[rank1]:[rank1]: Traceback (most recent call last):")
    later = record(0, "RuntimeError: Connection closed by peer", time_ns=20)
    first = record(1, "ValueError: boom on rank 1", time_ns=10, exit_code=3)
    records = sorted([later, first], key=lambda r: r["time_ns"])
    error = _job_failure(1, log, records)
    assert (error.rank, error.exit_code) == (1, 3)
    assert str(error).startswith("distributed job failed: rank 1 exited with code 3 (ValueError: boom on rank 1);")
    # the traceback never reached the output: the record's is appended under a header
    header = "--- traceback from rank 1's failure record (host node0):"
    recorded = ["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: boom on rank 1"]
    assert error.tail == ["y", "Traceback (most recent call last):", header, *recorded]


def test_without_records_or_summary_the_first_traceback_or_the_launchers_code_decides():
    log = job_log("[rank2]:Traceback (most recent call last):", "[rank0]:Traceback (most recent call last):")
    assert log.first_traceback_rank == 2
    error = _job_failure(1, log, [])
    assert (error.rank, error.exit_code) == (2, 1)
    # DeepSpeed's runner: no prefixes, only its own line with the rank's code
    deepspeed = job_log("some output", "[launch.py:1] Process 77 exits with return code = 5")
    error = _job_failure(1, deepspeed, [])
    assert (error.rank, error.exit_code) == (None, 5)
    assert str(error).startswith("distributed job failed: a rank (unknown which) exited with code 5; its last log")
    killed = _job_failure(-signal.SIGKILL, _JobLog(), [])
    assert str(killed).startswith("distributed job failed: a rank (unknown which) exited with code -9 (signal SIGKILL)")
    assert killed.tail == []


def test_a_rank_records_its_exception_and_a_non_zero_exit_but_not_a_clean_one(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    cases = (("error", ValueError("boom"), 1), ("exit", SystemExit(4), 4), ("clean", SystemExit(0), None))
    for case, raised, code in cases:
        folder = tmp_path / case
        monkeypatch.setenv(FAILURE_DIR_ENV, str(folder))
        with pytest.raises(type(raised)):
            with record_failures():
                raise raised
        records = _read_failure_records(str(folder))
        if code is None:
            assert records == []
            continue
        (only,) = records
        assert (only["rank"], only["exit_code"], only["host"]) == (3, code, socket.gethostname())
        assert only["error"] == f"{type(raised).__name__}: {raised}" and "Traceback" in only["traceback"]
        assert [p.name for p in folder.iterdir()] == [f"rank3-{os.getpid()}.json"]  # no .tmp left


def test_nested_records_keep_the_innermost_and_no_folder_means_no_record(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path))
    with pytest.raises(RuntimeError):
        with record_failures():
            try:
                with record_failures():
                    raise KeyError("inner cause")
            except KeyError as exc:
                raise RuntimeError("outer consequence") from exc
    assert [r["error"] for r in _read_failure_records(str(tmp_path))] == ["KeyError: 'inner cause'"]
    monkeypatch.delenv(FAILURE_DIR_ENV)
    with pytest.raises(ValueError):
        with record_failures():
            raise ValueError("nowhere to write")  # reporting is skipped, the error still propagates
    (tmp_path / "rank9-1.json").write_text(json.dumps({"rank": 9, "time_ns": 0}))
    (tmp_path / "rank8-1.json").write_text("{torn")  # a torn record is skipped
    assert [r["rank"] for r in _read_failure_records(str(tmp_path))] == [9, 0]  # by time
