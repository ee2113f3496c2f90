"""A stand-in stage worker for launcher tests: every rank prints to stdout and stderr, rank 0 an
event line; optionally one rank fails. Run as `python -m echo_ranks [options]` on each rank.

--fail-rank N: rank N raises ValueError("boom on rank N") (or exits with --hard CODE, leaving no
failure record). With --peer-follows every other rank fails ~50 ms later the way a peer of a
failed rank does (a RuntimeError like gloo's "Connection closed by peer") while rank N is still
in a slow teardown (3 s, so on a loaded machine too), so the peer's exit is the first one torchrun
sees.
--sleep S: ranks that do not fail sleep S seconds before finishing (timeout/interrupt tests).
--pid-dir D: each rank writes D/<rank>.pid first, so a test can check that it is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlflow.engine.backend.supervise import record_failures
from rlflow.engine.backend.supervise import line_buffered_output


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--hard", type=int, default=None)
    parser.add_argument("--peer-follows", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--pid-dir", default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.pid_dir:
        Path(args.pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    print(f"hello from rank {rank} of {world} omp={os.environ.get('OMP_NUM_THREADS')}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    if rank == 0:
        print("@@rlflow-event " + json.dumps({"event": "ready", "world_size": world}), flush=True)
    marker = Path(os.environ.get("RLFLOW_FAILURE_DIR", "."), "peer-failing")
    if rank == args.fail_rank:
        time.sleep(0.3)  # let the others reach their wait
        if args.hard is not None:
            os._exit(args.hard)
        try:
            with record_failures():  # the record is written as the error happens
                raise ValueError(f"boom on rank {rank}")
        finally:
            marker.touch()
            if args.peer_follows:
                time.sleep(3.0)  # a slow teardown (flushing, destroying process groups, ...)
    if args.fail_rank is not None and args.peer_follows:
        while not marker.exists():
            time.sleep(0.005)
        time.sleep(0.05)
        raise RuntimeError("Connection closed by peer (simulated): a remote worker crashed")
    time.sleep(args.sleep)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    line_buffered_output()
    with record_failures():
        main()
