"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class RlflowError(Exception):
    """Base for errors caused by input the user can fix (config, data, paths)."""


class ConfigError(RlflowError):
    """A config file or override is invalid; the message names the file, key and value."""


class DataError(RlflowError):
    """A data file is missing or malformed; the message names the file and line."""


class CheckpointError(RlflowError):
    """A checkpoint is missing, uncommitted, corrupted or locked by another run."""
