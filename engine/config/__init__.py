"""The run configuration: the typed schema (pydantic sections), YAML loading with `a.b=c`
overrides and line-numbered errors, secrets kept out of anything stored, and the sampling record
derived from it.

Owns: schema (Config and loading), sections (stages, execution, methods, model, base), yaml_io,
secrets, sampling.
May import: engine.errors only. Everything else in the engine imports this, never the reverse.
"""
