"""Datasets and batches: JSONL/CSV/Parquet records from any fsspec URL validated into typed
records, prompt formatting and encoding, padding, and the deterministic order batches are drawn in.

Owns: records, conversations, prompts (a stage's encoded prompt set), batching.
May import: engine.storage (its errors), engine.config, engine.seeds, engine.errors.
"""
