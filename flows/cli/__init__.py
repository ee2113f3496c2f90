"""The `rlflow` command line: `main` parses the command and each module here implements one.

May import: rlflow.flows, rlflow.tasks, rlflow.engine. Nothing imports this package but the
console entry point.
"""
