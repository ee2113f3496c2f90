"""How stages report: the metrics-sink interface (the MLflow implementation lives in
rlflow.tasks.tracking, so the engine never imports a tracker), the console progress bar, the
structured event log and user callbacks.

Owns: metrics, progress, phases (a step's timed phases).
May import: nothing else in the engine.
"""
