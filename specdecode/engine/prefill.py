"""Admission and chunked prefill, the first half of a serving step (engine/serving.py).

Owns: which waiting requests are admitted (FIFO, while rows and blocks allow), the prompt
chunk each step prefills (the fewest tokens left first, at most ``max_long_prefills`` long
ones), prefix-cache matching and publishing on the way, and a finished prompt's joining of
the decode batch (its first token sampled, the drafter told). `Prefill` is a base of
`ServingEngine`, whose queue, cache and batch it works on.
"""

from __future__ import annotations

import torch

from specdecode.engine import prefix, processing
from specdecode.engine.requests import Request, RequestEvent


class Prefill:
    """Admission and prefill methods of `ServingEngine` (see there for the fields they use)."""

    def _admit(self) -> None:
        pool = self.cache.pool
        owed = sum(self.cache.blocks_needed(r.request_id, r.prefill_target + self.round_room) for r in self.prefilling)
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_num_seqs:
            req = self.waiting[0]
            need = -(-(req.prefill_target + self.round_room) // pool.block_size)
            if need + owed > pool.num_free:
                break  # FIFO: later requests wait behind it rather than starve it
            self.waiting.popleft()
            self.cache.add_sequence(req.request_id)
            req.cached, req.features, req.matched = 0, [], False
            self.prefilling.append(req)
            owed += need

    def _prefill_chunk(self) -> list[RequestEvent]:
        """The prompt tokens this step's budget leaves after the decode round's positions
        (``max_num_batched_tokens`` less one plus γ per running request, at least one block),
        the request with the fewest left first, so a short prompt is not held behind a long
        one's chunks; at most ``max_long_prefills`` prompts with more than a budget left take
        part. In passes of one request's at most ``prefill_pass`` tokens: no padding, so no
        request needs blocks beyond its own chunk (prefill is compute-bound, so batching it
        would gain little)."""
        decode = sum(1 + req.gamma for req in self.running.values())
        budget = max(self.cache.block_size, self.max_num_batched_tokens - decode)
        done, last_logits, long = [], [], 0
        for req in self._prefill_order():
            if budget <= 0:
                break
            if not req.matched and self.prefix_caching:
                prefix.match(self.cache, req, bool(self.hidden_layers))
            left = req.prefill_target - req.cached
            if left > self.max_num_batched_tokens:
                long += 1
                if long > self.max_long_prefills:
                    continue
            n = min(left, budget)
            budget -= n
            self.cache.set_batch([req.request_id])
            end = req.cached + n
            while req.cached < end:
                m = min(end - req.cached, self.prefill_pass)
                self._reserve([m], prefill=True)  # a commit frees the blocks past what it commits
                tokens = torch.tensor([req.seq.token_ids[req.cached : req.cached + m]], device=self.device)
                positions = torch.arange(req.cached, req.cached + m, device=self.device)[None, :]
                scored = processing.wants_prompt_logprobs(req.seq, req.cached)  # every position's logits, not the last
                at = torch.arange(m if scored else 1, device=self.device)[None, :] + (0 if scored else m - 1)
                logits, hidden = self._target(tokens, positions, self.cache, logits_at=at)
                if scored:
                    processing.score_prompt(req.seq, req.cached, logits[0])
                    logits = logits[:, -1:]
                self.cache.commit(torch.tensor([m], device=self.device))
                req.cached += m
                if hidden is not None:
                    req.features.append(hidden[0])
                if self.prefix_caching:
                    prefix.publish(self.cache, req, prefill=bool(self.hidden_layers))
            if req.cached == req.prefill_target:
                done.append(req)
                last_logits.append(logits[0, 0])
        return self._join(done, torch.stack(last_logits)) if done else []

    def _prefill_order(self) -> list[Request]:
        """Fewest prompt tokens left first (stable: oldest first on ties)."""
        return sorted(self.prefilling, key=lambda r: r.prefill_target - r.cached)

    def _join(self, reqs: list[Request], logits: torch.Tensor) -> list[RequestEvent]:
        """Prefill done: fresh requests sample their first token; all join the decode batch."""
        fresh = [i for i, r in enumerate(reqs) if not r.resumed]
        events = []
        if fresh:
            seqs = [reqs[i].seq for i in fresh]
            first, logprobs = processing.sample_first(seqs, logits[fresh], self.eos_ids)
            for i, token, lp in zip(fresh, first, logprobs):
                seq = reqs[i].seq
                new = self._append_until_stop(seq, [token])
                if lp is not None:
                    seq.logprobs += lp[: len(new)]
                events.append(self._event(reqs[i], new))
        for req in reqs:
            self.prefilling.remove(req)
            if req.seq.finish_reason is not None:
                self.cache.free_sequence(req.request_id)
                continue
            self.running[req.request_id] = req
            rows = self.batch.extend([req.seq])
            if self.drafter is not None:
                features = [self._prompt_features(req)] if self.hidden_layers else None
                self.drafter.prefill(self.batch, rows, features)
        return events

    def _prompt_features(self, req: Request) -> torch.Tensor:
        """[len - 1, F]: the features of every token but the newest (a fresh request's first
        token has none yet; a resumed request recomputed all but its newest)."""
        features = torch.cat(req.features)
        req.features = []
        return features[: len(req.seq.token_ids) - 1]
