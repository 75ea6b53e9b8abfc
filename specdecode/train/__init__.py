"""Drafter training: `specdecode train` (self-distillation of a drafter on a frozen target).

Owns: the trainer's config (config.py), the corpus reader and window packer (corpus.py),
the training loop with evaluation, checkpoints and resume (trainer.py), the
distilled small model that the `draft_model` method loads (drafters/distill_net.py), and
self-distillation data: the target's own answers to instructions (regenerate.py).
Does not own: the drafters' networks (each method's file under specdecode/drafters/
names its `Net`) or their folder format (drafters/learned.py).
"""
