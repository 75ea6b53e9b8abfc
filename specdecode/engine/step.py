"""The round: propose → verify → commit/rollback, for every row of a batch at once.

Owns: the drafter a target decodes with, the order of calls in a round, stop
conditions, and per-request statistics. Plain decoding is the same round with no
drafter (γ = 0: each round verifies nothing and samples one bonus token).
Does not own: requests coming and going, prefill and the KV cache's blocks
(engine/serving.py, which builds on this class), how drafts are made (drafters/), the
acceptance rule (verify.py), or text (entrypoints/).

A round, for every row at once::

    draft   = drafter.propose(batch, γ)                      # chains or trees, q or None
    logits  = target([last, d_1..d_γ], positions, cache)     # writes K/V past each row's length
    out, n  = verify(p, draft)                               # accepted + recovered/bonus token
    cache.commit(n + 1); drafter.on_verified(batch, n)       # rejected slots are rolled back

A tree runs the same round with a tree mask and depth positions; its accepted path's
K/V are compacted into contiguous slots before the commit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdecode.config import AutoSpec, SpecConfig, SpecDecodeError
from specdecode.drafters.auto import resolve_auto
from specdecode.drafters.base import Draft, Drafter, DrafterContext
from specdecode.drafters.registry import create_drafter
from specdecode.core.batch import Batch, Sequence, SpecStats
from specdecode.cache.kv_cache import KVCache
from specdecode.model.cpu_int4 import cpu_lib
from specdecode.model.loader import LoadedModel
from specdecode.engine import processing
from specdecode.core.sampling import Logprob, argmax, logits_to_probs
from specdecode.core.tree import commit_paths
from specdecode.core.verify import greedy_verify, rejection_sample, tree_greedy_verify, tree_rejection_sample


@dataclass
class Verified:
    """One verify pass's result, per row."""

    out: torch.Tensor  # [B, w+1] accepted drafts, then the recovered / bonus token, -1 padded
    num_accepted: torch.Tensor  # [B]
    num_draft: torch.Tensor  # [B]
    aux_logits: torch.Tensor | None = None  # [B, A, V] at the proposal's aux branch
    hidden: torch.Tensor | None = None  # [B, w+1, F] target features at the committed tokens (root first)
    num_positions: int | None = None  # positions the pass verified, where not rows + drafts (trees, aux branches)
    logprobs: list[list[Logprob] | None] | None = None  # per row asking: one per emitted token


@dataclass
class StepEvent:
    """What one round added to one request."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None  # None while running; "stop" (EOS / stop string) or "length"
    stats: SpecStats  # the request's running speculation counters


class Engine:
    """Speculative rounds over one target model and at most one drafter (see `ServingEngine`)."""

    def __init__(
        self,
        target: LoadedModel,
        spec: SpecConfig | AutoSpec | None,
        max_model_len: int,
        drafter: Drafter | None = None,
        quantization: str | None = None,
        batch_invariant: bool | None = None,
    ) -> None:
        """``drafter`` overrides the registry: bring your own `Drafter` (``spec`` still gives γ).
        ``batch_invariant`` makes every pass compute each position alone (Transformer.forward),
        so speculative greedy equals plain greedy bit for bit. None (the default) turns it on
        where our row-invariant CPU kernels run (fp32 / bf16 on a CPU our library is built
        for), at no cost worth a flag; elsewhere (CUDA) it would run attention a query at a
        time, so it stays off unless asked for."""
        if drafter is not None and spec is None:
            raise ValueError("a custom drafter needs a SpecConfig for its num_speculative_tokens")
        self.target = target
        self.model = target.model
        self.auto_choice: str | None = None  # what "auto" chose, and why
        if isinstance(spec, AutoSpec):
            spec, self.auto_choice = resolve_auto(spec, target)
        self.spec = spec
        param = self.model.embed.weight  # the activation dtype (linears may hold quantized weights)
        if batch_invariant is None:
            batch_invariant = param.device.type == "cpu" and param.dtype in (torch.float32, torch.bfloat16)
            batch_invariant = batch_invariant and cpu_lib() is not None
        self.batch_invariant = batch_invariant
        self.max_model_len = max_model_len
        self.device = param.device
        self.drafter = drafter
        if quantization == "auto":  # the drafters' weights in the format the target's got
            quantization = target.quantization
        if spec is not None and drafter is None:
            ctx = DrafterContext(target=target, dtype=param.dtype, device=param.device, quantization=quantization)
            self.drafter = create_drafter(spec, ctx)
        self.gamma = spec.num_speculative_tokens if spec is not None else 0
        # Room past each row's length for one round's draft tokens (and the root).
        self.round_room = self.drafter.max_draft_tokens(self.gamma) + 2 if self.drafter is not None else 2
        if self.round_room >= max_model_len:
            raise SpecDecodeError(
                f"max_model_len={max_model_len} is too small for a round of up to {self.round_room - 2} draft tokens; "
                f"give max_model_len >= {self.round_room + 1}"
            )
        # target layers the drafter reads; every target pass returns their features
        self.hidden_layers: tuple[int, ...] = self.drafter.hidden_layers if self.drafter is not None else ()
        self.eos_ids = set(target.config.eos_token_ids)
        self.tokenizer = target.tokenizer

    def _target(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, block_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None, valid: torch.Tensor | None = None, packed: bool = False,
        fp32_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """One target pass: logits, and the drafter's features [B, T, F] (None if it reads none).
        ``fp32_logits`` False where only their argmax is read (Transformer.forward)."""
        out = self.model(
            tokens, positions, cache, block_mask=block_mask, logits_at=logits_at,
            hidden_layers=self.hidden_layers, batch_invariant=self.batch_invariant, valid=valid, packed=packed,
            fp32_logits=fp32_logits,
        )  # fmt: skip
        if not self.hidden_layers:
            return out, None
        logits, hidden = out
        return logits, torch.cat(hidden, dim=-1)

    def _verify_round(self, batch: Batch, cache: KVCache, draft: Draft | None) -> Verified:
        """One target pass over [last, drafts]; commits the accepted K/V."""
        B = len(batch)
        if draft is None:
            draft = Draft(tokens=torch.empty(B, 0, dtype=torch.long, device=self.device))
        if draft.tree is not None:
            if max(draft.tree.fanout, default=0) > 1 or draft.aux is not None:
                return self._verify_tree(batch, cache, draft)
            # Every row's tree is a chain (nodes 0, 1, 2, ... in order): the chain round is cheaper.
            draft = Draft(tokens=draft.tree.tokens[:, 1:], q=draft.q[:, 1:] if draft.q is not None else None)
        if draft.q is None and any(s.grammar is not None for s in batch.seqs):
            draft = dataclasses.replace(draft, tokens=processing.cut_by_grammar(batch.seqs, draft.tokens))
        num_draft = draft.num_tokens
        width = int(num_draft.max()) if B else 0  # rows that found nothing do not make others pay
        draft_tokens = draft.tokens[:, :width]
        q = draft.q[:, :width] if draft.q is not None else None
        tokens = torch.cat([batch.last_tokens(), draft_tokens.clamp(min=0)], dim=1)  # [B, 1 + w]
        positions = cache.lengths[:, None] + torch.arange(1 + width, device=self.device)
        valid = torch.arange(1 + width, device=self.device)[None, :] <= num_draft[:, None]  # a row pays for its own drafts
        greedy = batch.all_greedy  # only the argmax is read: the logits stay in the head's dtype
        # logits [N, V] at the real positions; hidden [B, 1 + w, F]
        raw, hidden = self._target(tokens, positions, cache, valid=valid, packed=True,
                                   fp32_logits=not greedy or processing.wants_logprobs(batch.seqs))  # fmt: skip
        logits = processing.process(batch.seqs, self.eos_ids, raw, processing.chain_contexts, draft_tokens, num_draft)
        rule = draft.acceptance  # the drafter's own acceptance rule, if it brought one
        if rule is not None and rule.lossy:  # LOSSY opt-in (typical acceptance): flag the requests it bent
            # a greedy row's p is one-hot, where a rule decides as greedy verification (its contract,
            # drafters/base.Acceptance), and a row without drafts samples from p alone
            for seq, n in zip(batch.seqs, num_draft.tolist()):
                seq.stats.lossy |= n > 0 and not seq.params.greedy
        if greedy:
            out, num_accepted = greedy_verify(_argmax_at(logits, valid), draft_tokens)
        elif rule is not None:
            p = _probs_at(logits, valid, batch, zero_padding=True)  # the rule may read every position (entropy)
            out, num_accepted = rule(p, draft_tokens, batch.generators)
        else:
            out, num_accepted = rejection_sample(_probs_at(logits, valid, batch), q, draft_tokens, batch.generators)
        cache.commit(num_accepted + 1)
        logprobs = processing.logprobs(batch.seqs, raw, logits, valid, out, num_accepted)
        return Verified(out, num_accepted, num_draft, None, hidden, logprobs=logprobs)

    def _verify_tree(self, batch: Batch, cache: KVCache, draft: Draft) -> Verified:
        """One target pass over every row's tree (and aux branch); the accepted path's K/V are
        compacted in the cache, and the aux nodes' K/V dropped with the rejected nodes'."""
        tree, aux = draft.tree, draft.aux
        tokens, positions, mask = tree.tokens.clamp(min=0), tree.positions(cache.lengths), tree.mask
        valid = tree.valid
        if aux is not None:
            B, N, A = tree.batch_size, tree.num_nodes, aux.tokens.shape[1]
            tokens = torch.cat([tokens, aux.tokens], dim=1)  # [B, N + A]
            positions = torch.cat([positions, cache.lengths[:, None] + aux.offsets], dim=1)
            mask = torch.cat([torch.cat([tree.mask, tree.mask.new_zeros(B, N, A)], dim=2), aux.mask], dim=1)
            valid = torch.cat([valid, torch.ones_like(aux.tokens, dtype=torch.bool)], dim=1)
        # what the pass computes: the padded layout with an aux branch, else the real nodes
        num_positions = tokens.numel() if aux is not None else int(valid.sum())
        aux_logits = None
        if aux is not None:  # the aux branch's logits are read whole: the padded layout
            raw, hidden = self._target(tokens, positions, cache, block_mask=mask, valid=valid)
            raw, aux_logits = raw[:, : tree.num_nodes], raw[:, tree.num_nodes :]  # [B, N, V], [B, A, V]
            raw, valid = raw.flatten(0, 1)[tree.valid.reshape(-1)], tree.valid  # as packed: [N, V]
        else:
            raw, hidden = self._target(tokens, positions, cache, block_mask=mask, valid=valid, packed=True,
                                       fp32_logits=not batch.all_greedy or processing.wants_logprobs(batch.seqs))  # fmt: skip
        logits = processing.process(batch.seqs, self.eos_ids, raw, processing.tree_contexts, tree)  # [N, V]
        if batch.all_greedy:
            out, num_accepted, nodes = tree_greedy_verify(_argmax_at(logits, valid), tree)  # [B, N] -> paths
        else:
            out, num_accepted, nodes = tree_rejection_sample(_probs_at(logits, valid, batch), draft.q, tree, batch.generators)
        commit_paths(cache, nodes, num_accepted)
        if hidden is not None:  # the accepted path's features, root first
            hidden = hidden.gather(1, nodes.clamp(min=0)[:, :, None].expand(-1, -1, hidden.shape[-1]))
        logprobs = processing.logprobs(batch.seqs, raw, logits, valid, out, num_accepted, nodes)
        return Verified(out, num_accepted, draft.num_tokens, aux_logits, hidden, num_positions, logprobs)

    def _append_tokens(
        self, batch: Batch, out: torch.Tensor, num_accepted: torch.Tensor, num_draft: torch.Tensor,
        logprobs: list[list[Logprob] | None] | None = None,
    ) -> list[StepEvent]:  # fmt: skip
        """Append each row's emitted tokens, stopping at EOS, stop strings or its length limit."""
        events = []
        for b, (seq, row, n_acc, n_draft) in enumerate(
            zip(batch.seqs, out.tolist(), num_accepted.tolist(), num_draft.tolist())
        ):
            new = self._append_until_stop(seq, row[: n_acc + 1])
            if logprobs is not None and logprobs[b] is not None:
                seq.logprobs += logprobs[b][: len(new)]
            if len(new) <= n_acc:  # cut by EOS, a stop string or max_tokens among the accepted drafts: the
                # round counts the drafts it emitted, all accepted (max_tokens 4 at γ 8 said τ 9; now 4)
                n_draft = n_acc = len(new)
            seq.stats.record(n_draft, n_acc)
            events.append(StepEvent(seq.request_id, new, seq.finish_reason, seq.stats))
        return events

    def _append_until_stop(self, seq: Sequence, tokens: list[int]) -> list[int]:
        limit = min(seq.num_prompt + seq.params.max_tokens, self.max_model_len)
        added: list[int] = []
        for t in tokens:
            seq.token_ids.append(t)
            added.append(t)
            if seq.grammar is not None:
                seq.grammar.advance(t)
            if (t in self.eos_ids and not seq.params.ignore_eos) or t in seq.params.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.grammar is not None and seq.grammar.done:  # the structured output is complete
                seq.finish_reason = "stop"
            elif len(seq.token_ids) >= limit:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        if seq.params.stop and self.tokenizer is not None:
            cut = self._stop_string_cut(seq, len(added))
            if cut is not None:
                first_added = len(seq.token_ids) - len(added)
                del seq.token_ids[cut:]
                added = added[: max(0, cut - first_added)]
                seq.finish_reason = "stop"
        return added

    def _stop_string_cut(self, seq: Sequence, num_new: int) -> int | None:
        """Index into token_ids just after the token that completes a stop string, if any."""
        out = seq.output_ids
        decode = self.tokenizer.decode
        text = decode(out, skip_special_tokens=True)  # once a step, not once per stop string (a request
        if not any(s in text for s in seq.params.stop):  # may give thousands, and every step would pay for each)
            return None
        for k in range(max(1, len(out) - num_new + 1), len(out) + 1):
            text = decode(out[:k], skip_special_tokens=True)
            if any(s in text for s in seq.params.stop):
                return seq.num_prompt + k
        return None


def _argmax_at(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, T] the target's argmax at each real position of a pass, from its packed logits
    [N, V] (``valid``'s True entries, row-major); 0 at padding, which verification never reads."""
    if logits.shape[0] == valid.numel():  # no padding (plain decoding, a chain batch of one)
        return argmax(logits).view(valid.shape)
    out = torch.zeros(valid.numel(), dtype=torch.long, device=logits.device)
    out[valid.reshape(-1)] = argmax(logits)
    return out.view(valid.shape)


def _probs_at(logits: torch.Tensor, valid: torch.Tensor, batch: Batch, zero_padding: bool = False) -> torch.Tensor:
    """[B, T, V] p at each real position of a pass, from its packed logits [N, V], each under its
    row's sampling settings. Padding is left unwritten unless ``zero_padding``: the chain and tree
    rules mask out whatever p holds past each row's drafts (they sample only at real positions),
    and zeroing it writes a whole vocabulary per padded position, a real cost in a big batch."""
    real = valid.reshape(-1)
    rows = real.nonzero()[:, 0] // valid.shape[1]  # [N] the row of each real position
    p_real = logits_to_probs(
        logits[:, None], batch.temperature[rows], batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
    )[:, 0]
    p = (p_real.new_zeros if zero_padding else p_real.new_empty)(valid.numel(), p_real.shape[-1])
    p[real] = p_real
    return p.view(*valid.shape, -1)
