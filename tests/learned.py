"""Tiny learned drafters for tests: a net trained for a few seconds on a tiny target's own
samples (so that drafts are often accepted and every acceptance path runs), saved as a
drafter folder. Owns no assertion."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.drafters.learned import TrainBatch, save_net
from specdecode.cache.kv_cache import NoCache
from specdecode.model.transformer import Transformer
from specdecode.core.sampling import logits_to_probs, sample


def target_samples(target: Transformer, num: int, length: int, seed: int = 0) -> torch.Tensor:
    """[num, length] sequences sampled from the target at temperature 0.7 (short random prompts)."""
    gen = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    tokens = torch.randint(4, V, (num, 3), generator=gen)
    with torch.no_grad():
        while tokens.shape[1] < length:
            cache = NoCache(num, "cpu")
            positions = torch.arange(tokens.shape[1]).expand(num, -1)
            logits = target(tokens, positions, cache)[:, -1:]
            p = logits_to_probs(logits, torch.full((num,), 0.7), torch.zeros(num, dtype=torch.long), torch.ones(num))
            tokens = torch.cat([tokens, sample(p[:, 0], [gen] * num)[:, None]], dim=1)
    return tokens


def train_batch(target: Transformer, tokens: torch.Tensor, hidden_layers: tuple[int, ...]) -> TrainBatch:
    B, T = tokens.shape
    with torch.no_grad():
        positions = torch.arange(T).expand(B, -1)
        logits, hidden = target(tokens, positions, NoCache(B, "cpu"), hidden_layers=hidden_layers)
    return TrainBatch(tokens, torch.cat(hidden, dim=-1), logits, torch.ones(B, T, dtype=torch.bool), target)


def train_net(net: torch.nn.Module, target: Transformer, steps: int, seed: int = 0, lr: float = 3e-3) -> list[dict]:
    """Adam on the target's samples; returns the metrics of each step."""
    torch.manual_seed(seed)
    data = target_samples(target, 32, 24, seed)
    net.prepare(torch.bincount(data.flatten(), minlength=target.config.vocab_size))
    return [metrics for _, metrics in fit(net, train_batch(target, data, net.hidden_layers), steps, lr)]


def fit(net: torch.nn.Module, batch: TrainBatch, steps: int, lr: float = 3e-3) -> list[tuple[float, dict]]:
    """Adam on one fixed batch; (loss, metrics) of each step."""
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=lr)
    history = []
    for _ in range(steps):
        loss, metrics = net.training_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((float(loss.detach()), metrics))
    return history


def trained_folder(cls: type, target: Transformer, path: Path, steps: int = 60, **config) -> Path:
    net = cls.from_target(cls.Config(**config), target)
    train_net(net, target, steps)
    return save_net(net, target, path)
