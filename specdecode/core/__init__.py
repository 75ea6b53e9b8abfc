"""Core types and rules below the drafters and the engine: the decoding batch (batch.py)."""
