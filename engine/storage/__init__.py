"""Everything written to a run's storage through fsspec (local paths, s3://): checkpoints
committed atomically, file helpers, the replica mirror, the run lock, the policy export, and
one-line storage errors.

Owns: checkpoint, files, mirror, lock, export, errors.
May import: engine.config, engine.models, engine.telemetry, engine.errors, engine.faults.
"""
