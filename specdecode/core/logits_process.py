"""What plain decoding does to the target's raw logits at a position, before temperature:
token masks, bias and penalties, given the tokens before that position.

Owns: `process_logits`, applied to every position of a verify pass (each under its row's
settings and its own context: the committed tokens plus the draft tokens on its path), to
the first token after a prompt and to drafters' own logits; each row's state for it
(`row_states`); the per-request token-id forms of `SamplingParams`' strings
(`bad_words_ids`). The same function serves plain decoding (a pass of one position, no
draft prefix), so speculative and plain decoding see the same p.
Does not own: temperature, min-p, top-k and top-p (sampling.py), or which positions a
pass holds (engine/step.py).

Order, as vLLM's sampler: the structured output's grammar, allowed_token_ids, bad_words,
min_tokens (EOS and stop token ids held back), logit_bias, then repetition, frequency and
presence penalties (over the output; repetition over the prompt too). Masked tokens get -inf.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from specdecode.config import SamplingParams


def bad_words_ids(params: SamplingParams, tokenizer: Any) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (vLLM's two forms): the last token
    of a form is never sampled where the output ends with the rest of it."""
    out: list[list[int]] = []
    for word in params.bad_words:
        for text in (word, " " + word.lstrip()):
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in out:
                out.append(ids)
    return out


class RowState:
    """One request's view for processing: its prompt, its committed output, its settings.
    ``stop_ids``: the tokens min_tokens holds back (EOS unless ignored, and stop_token_ids)."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int], params: SamplingParams,
                 eos_ids: Iterable[int], bad_words: list[list[int]] | None = None, grammar: Any = None) -> None:  # fmt: skip
        self.prompt, self.output, self.params, self.grammar = prompt, output, params, grammar
        eos = () if params.ignore_eos else tuple(eos_ids)
        self.stop_ids = sorted(set(eos) | set(params.stop_token_ids))
        self.bad_words = bad_words or []


def row_states(seqs: Sequence[Any], eos_ids: Iterable[int]) -> list[RowState | None] | None:
    """Each sequence's state (None where its settings process nothing); None for all. A
    sequence has ``prompt_ids``, ``output_ids``, ``params``, ``bad_words_ids`` and ``grammar``
    (core/batch.py's `Sequence`)."""
    if not any(s.params.processes_logits for s in seqs):
        return None
    return [RowState(s.prompt_ids, s.output_ids, s.params, eos_ids, s.bad_words_ids, s.grammar)
            if s.params.processes_logits else None for s in seqs]  # fmt: skip


def process_logits(logits: Tensor, rows: Sequence[int], prefixes: Sequence[Sequence[int]],
                   states: Sequence[RowState | None]) -> Tensor:  # fmt: skip
    """logits [N, V] raw, one position each -> float32 [N, V] processed.

    Position i belongs to row ``rows[i]`` and follows that row's committed output plus
    ``prefixes[i]`` (the draft tokens on its path, oldest first). Rows whose state is None
    (nothing to process) are only converted to float32.
    """
    out = logits.float().clone()
    V = out.shape[-1]
    by_row: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if states[r] is not None:
            by_row.setdefault(r, []).append(i)
    for r, idx in by_row.items():
        st = states[r]
        sp = st.params
        at = torch.tensor(idx, device=out.device)
        x = out[at]  # [n, V] this row's positions
        if st.grammar is not None:  # a structured.Grammar, in step with the committed output
            for j, i in enumerate(idx):
                allowed = st.grammar.mask(prefixes[i])
                if allowed is not None:  # None: the prefix left the grammar, so no draft reaches here
                    x[j].masked_fill_(~allowed.to(x.device), float("-inf"))
        if sp.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool, device=out.device)
            keep[[t for t in sp.allowed_token_ids if t < V]] = True
            x.masked_fill_(~keep, float("-inf"))
        for j, i in enumerate(idx):
            context = list(st.output) + list(prefixes[i])
            banned = [w[-1] for w in st.bad_words if len(w) <= len(context) + 1
                      and (len(w) == 1 or context[len(context) - len(w) + 1 :] == w[:-1])]  # fmt: skip
            if sp.min_tokens and len(context) < sp.min_tokens:
                banned += st.stop_ids
            banned = [t for t in banned if t < V]
            if banned:
                x[j, banned] = float("-inf")
        if sp.logit_bias:
            ids = torch.tensor([t for t, _ in sp.logit_bias if t < V], dtype=torch.long, device=out.device)
            vals = torch.tensor([b for t, b in sp.logit_bias if t < V], dtype=x.dtype, device=out.device)
            x[:, ids] += vals
        if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
            x = _penalize(x, st, [prefixes[i] for i in idx])
        out[at] = x
    return out


def _penalize(x: Tensor, st: RowState, prefixes: list[Sequence[int]]) -> Tensor:
    """x [n, V]; position j's output so far is the committed output plus ``prefixes[j]``."""
    n, V = x.shape
    sp = st.params
    output = torch.tensor(list(st.output), dtype=torch.long, device=x.device)
    counts = torch.bincount(output, minlength=V)[:V].to(x.dtype).expand(n, V).clone()  # [n, V]
    for j, pre in enumerate(prefixes):
        if pre:
            ids = torch.tensor(list(pre), device=x.device)
            counts[j].index_add_(0, ids, torch.ones(len(pre), dtype=x.dtype, device=x.device))
    if sp.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = torch.tensor(list(st.prompt), dtype=torch.long, device=x.device)
        seen[:, prompt[prompt < V]] = True
        rp = sp.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if sp.frequency_penalty:
        x = x - sp.frequency_penalty * counts
    if sp.presence_penalty:
        x = x - sp.presence_penalty * (counts > 0).to(x.dtype)
    return x
