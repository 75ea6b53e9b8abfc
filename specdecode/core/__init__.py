"""The rules below the drafters and the engine: the decoding batch (batch.py), acceptance
(verify.py), draft trees (tree.py), sampling (sampling.py), logits processing
(logits_process.py) and grammars (structured.py)."""
