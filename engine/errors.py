"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class RlflowError(Exception):
    """Base for errors caused by input the user can fix (config, data, paths)."""


class ConfigError(RlflowError):
    """A config file or override is invalid; the message names the file, key and value."""


class DataError(RlflowError):
    """A data file is missing or malformed; the message names the file and line."""


class CheckpointError(RlflowError):
    """A checkpoint is missing, uncommitted, corrupted or locked by another run."""


class StagePreempted(Exception):
    """SIGTERM (spot reclaim, eviction): the stage committed a checkpoint and stopped; running
    it again continues there."""

    exit_code = 143  # 128 + SIGTERM, what schedulers expect of a process that obeyed SIGTERM


class StageHung(RuntimeError):
    """No step finished within stage.hang_timeout_s; a retry resumes from the last checkpoint."""


class NonFiniteUpdates(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


class RewardSourceError(RuntimeError):
    """PPO's reward source failed while scoring a batch; reward.on_failure decides what follows."""


class RunHalted(RlflowError):
    """A guard (KL circuit breaker, reward failure) or its operator stopped the run at a committed
    checkpoint; the message says how to continue it. Not a failure of the input, hence its own
    exit code."""

    exit_code = 3


class RewardFunctionError(RlflowError):
    """A reward function or rule raised, returned a non-finite value or ran past reward.timeout_s
    under reward.on_error=fail; the message names the source and the sample."""
