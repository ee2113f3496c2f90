"""Shared test helpers: imported as `helpers.<module>` (tests/ is on sys.path); no test module imports another."""
