"""The shared staging memory and the replica's report region."""

from __future__ import annotations

import pytest
import torch

from rlflow.engine.rollout.staging import REPORT_BYTES, Staging, read_report, write_report


def test_the_replica_report_round_trips_through_shared_memory():
    staging = Staging(slot_bytes=128, slots=2, report_bytes=REPORT_BYTES)
    assert staging.read_report() == {}
    write_report(staging.buffer, {"dtype": "bfloat16", "tensors": 3})
    assert staging.read_report() == {"dtype": "bfloat16", "tensors": 3}
    assert staging.slot_offset(0) == REPORT_BYTES and staging.slot_offset(3) == REPORT_BYTES + 128
    with open(staging.path, "rb") as other:  # what the replica opens: the same pages
        assert other.read(8)[:1] != b"\0"
    staging.close()
    with pytest.raises(ValueError, match="does not fit"):
        write_report(torch.zeros(REPORT_BYTES, dtype=torch.uint8), {"x": "y" * REPORT_BYTES})
    assert read_report(torch.zeros(16, dtype=torch.uint8)) == {}
