"""The launcher's own pieces that can run in this process (the rest runs in test_sandbox.py, for real)."""

import pytest

from rlflow.engine.envs import sandbox_init


def test_a_failed_mount_names_its_target_and_the_reason(tmp_path):
    with pytest.raises(OSError, match=f"mount {tmp_path}/absent: No such file or directory"):
        sandbox_init._mount("tmpfs", str(tmp_path / "absent"), "tmpfs", 0)

