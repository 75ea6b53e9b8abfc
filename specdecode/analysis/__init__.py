"""What speculation should buy, before running it: Leviathan's speedup model (theory.py) and
the verification roofline of a model on a device (roofline.py)."""
