"""What plain decoding does at each position of a pass, for the rows that ask for more than
temperature / top-k / top-p: each position's context, its processed logits, logprobs.

Owns: a request's processing state (`setup_sequence`: its token ids checked against the
vocabulary, its bad words tokenized, its grammar compiled), the context of every position
of a chain or tree pass (the row's output plus the draft tokens on its path), the pass's
logits processed position by position (`process`), deterministic drafts cut where they
leave a grammar (`cut_by_grammar`), the emitted tokens' logprobs (`logprobs`), and the
first token after a prompt (`sample_first`), which is a round with no drafts.
Does not own: the processing itself (logits_process.py, structured.py), the order of a
round (engine/step.py), or the acceptance rule (verify.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.core.batch import Sequence
from specdecode.core.logits_process import bad_words_ids, process_logits, row_states
from specdecode.core.sampling import Logprob, argmax, logits_to_probs, sample, sampling_tensors, token_logprobs
from specdecode.core.structured import Grammar
from specdecode.core.tree import TreeBatch


def setup_sequence(seq: Sequence, tokenizer: Any, vocab: int, eos_ids: Iterable[int]) -> None:
    """Check a new request's token ids and build what its processing needs; bad input raises
    `SpecDecodeError` (one line)."""
    params = seq.params
    if params.n != 1:
        raise SpecDecodeError(f"the engine takes one sample per request, got n={params.n}: add one request per sample")
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or ())):  # fmt: skip
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise SpecDecodeError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
    if (params.bad_words or params.structured is not None) and tokenizer is None:
        raise SpecDecodeError("bad_words and structured output need a tokenizer; this model folder has none")
    if params.bad_words:
        seq.bad_words_ids = bad_words_ids(params, tokenizer)
    if params.structured is not None:
        seq.grammar = Grammar(params.structured, tokenizer, vocab, sorted(eos_ids))


def process(seqs: list[Sequence], eos_ids: Iterable[int], raw: torch.Tensor, contexts: Callable, *args: Any) -> torch.Tensor:
    """The packed logits [N, V] processed, each position with its own context: the row's
    output and the draft tokens on its path (``contexts(*args)`` lists them in packed order)."""
    states = row_states(seqs, eos_ids)
    return raw if states is None else process_logits(raw, *contexts(*args), states)


def wants_logprobs(seqs: list[Sequence]) -> bool:
    return any(s.params.logprobs is not None for s in seqs)


def logprobs(seqs: list[Sequence], raw: torch.Tensor, processed: torch.Tensor, valid: torch.Tensor,
             out: torch.Tensor, num_accepted: torch.Tensor, nodes: torch.Tensor | None = None,
             ) -> list[list[Logprob] | None] | None:  # fmt: skip
    """Per row asking, a `Logprob` for each emitted token, from the verify pass's logits at
    the position that emitted it (chains: position j; trees: the path's node j)."""
    if not wants_logprobs(seqs):
        return None
    index = (valid.reshape(-1).long().cumsum(0) - 1).view(valid.shape)  # [B, T] packed index of each position
    result: list[list[Logprob] | None] = [None] * len(seqs)
    for b, seq in enumerate(seqs):
        sp = seq.params
        if sp.logprobs is None:
            continue
        n = int(num_accepted[b]) + 1
        at = index[b, :n] if nodes is None else index[b, nodes[b, :n]]
        result[b] = token_logprobs(_logprob_table(sp, raw[at], processed[at]), out[b, :n].tolist(), sp.logprobs)
    return result


def wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Whether a prefill pass from ``start`` holds prompt positions still to be scored."""
    return seq.params.prompt_logprobs is not None and start < seq.num_prompt - 1 and len(seq.prompt_logprobs) <= start + 1


def score_prompt(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """The prompt tokens' logprobs from a prefill pass's logits [m, V] at positions start..:
    position t's logits score prompt token t + 1 (the model's own distribution, as vLLM's)."""
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first token has no context to be scored in
    end = min(start + logits.shape[0], seq.num_prompt - 1)  # past the prompt: output tokens of a resumed request
    if end <= start:
        return
    table = torch.log_softmax(logits[: end - start].float(), dim=-1)
    seq.prompt_logprobs += token_logprobs(table, seq.token_ids[start + 1 : end + 1], seq.params.prompt_logprobs)


def sample_first(seqs: list[Sequence], raw: torch.Tensor, eos_ids: Iterable[int]) -> tuple[list[int], list]:
    """The first output token after each prompt (raw logits [B, V]), as a round with no drafts
    would sample it, and its `Logprob`s where asked (else None)."""
    params = [s.params for s in seqs]
    states = row_states(seqs, eos_ids)
    logits = raw if states is None else process_logits(raw, range(len(seqs)), [[]] * len(seqs), states)
    if all(p.greedy for p in params):
        first = argmax(logits).tolist()
    else:
        p = logits_to_probs(logits[:, None], *sampling_tensors(params, raw.device))[:, 0]  # [B, V]
        first = sample(p, [s.generator for s in seqs]).tolist()
    valid = torch.ones(len(seqs), 1, dtype=torch.bool, device=raw.device)
    out = torch.tensor(first, device=raw.device)[:, None]
    lps = logprobs(seqs, raw, logits, valid, out, torch.zeros_like(out[:, 0]))
    return first, lps or [None] * len(seqs)


def cut_by_grammar(seqs: list[Sequence], tokens: torch.Tensor) -> torch.Tensor:
    """Deterministic chains [B, γ] (-1 padded) cut at their first token outside the row's
    grammar: verification would reject it for sure (p gives it 0) and sample from p itself,
    as the bonus position the cut leaves does, so the output's law is unchanged and the
    positions past it are not computed. (A sampled draft is not cut: its rejection samples
    from the residual p - q, not p.)"""
    rows = tokens.tolist()
    for b, seq in enumerate(seqs):
        if seq.grammar is None:
            continue
        real = rows[b][: next((i for i, t in enumerate(rows[b]) if t < 0), len(rows[b]))]
        n = seq.grammar.allows(real)
        if n < len(real):
            rows[b] = real[:n] + [-1] * (len(rows[b]) - n)
            seq.stats.num_grammar_cut_tokens += len(real) - n
    return torch.tensor(rows, dtype=tokens.dtype, device=tokens.device).view(tokens.shape)


def chain_contexts(drafts: torch.Tensor, num_draft: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """The row and draft prefix of each real position of a chain pass, in packed order:
    position j of row b follows d_1..d_j."""
    rows, prefixes = [], []
    for b, (row, n) in enumerate(zip(drafts.tolist(), num_draft.tolist())):
        rows += [b] * (n + 1)
        prefixes += [row[:j] for j in range(n + 1)]
    return rows, prefixes


def tree_contexts(tree: TreeBatch) -> tuple[list[int], list[list[int]]]:
    """The row and path of each real node of a tree pass, in packed order: node n follows
    the tokens of its ancestors below the root, then its own."""
    rows, prefixes = [], []
    for b, (tokens, parents, valid) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist())):
        path: dict[int, list[int]] = {0: []}
        for n in range(len(tokens)):
            if not valid[n]:
                continue
            if n > 0:
                path[n] = path[parents[n]] + [tokens[n]]
            rows.append(b)
            prefixes.append(path[n])
    return rows, prefixes


def _logprob_table(sp: SamplingParams, raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
    """[n, V] the log-probabilities a request's ``logprobs_mode`` reports: the model's own
    (raw), or those of the distribution its tokens are drawn from (processed; at temperature
    0 the processed logits' softmax, as the one-hot would say nothing)."""
    if sp.logprobs_mode == "raw_logprobs":
        return torch.log_softmax(raw.float(), dim=-1)
    if sp.greedy:
        return torch.log_softmax(processed.float(), dim=-1)
    return logits_to_probs(processed[None], *sampling_tensors([sp], processed.device))[0].log()
