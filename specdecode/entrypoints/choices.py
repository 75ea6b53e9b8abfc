"""One OpenAI choice as it is generated: its events as text deltas and logprobs, in the wire
format of both endpoints, and the usage of a request's choices together.

Owns: turning a request's `RequestEvent`s into safe-to-show text (stop strings cut, partial
characters and stop-string prefixes held back), its logprobs objects (chat's ``content``
list, completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs``), the usage object
(OpenAI's, with per-request speculation statistics) summed over a request's n x prompts
choices, and cancelling a choice whose client went away.
Does not own: the routes and the request's flow (server.py), validation (openai_protocol.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any, Callable, Sequence

from specdecode.config import SamplingParams
from specdecode.core.batch import SpecStats
from specdecode.core.sampling import Logprob
from specdecode.entrypoints.outputs import RequestMetrics

LOGPROB_FLOOR = -9999.0  # what a -inf logprob is sent as (JSON has no infinity), as vLLM does


class Choice:
    """One sample of one prompt: ``index`` is its place among the request's choices."""

    def __init__(self, app: Any, request_id: str, events: asyncio.Queue, params: SamplingParams, arrival: float,
                 index: int = 0, echo: str = "", prompt_ids: Sequence[int] = ()) -> None:  # fmt: skip
        self.app, self.request_id, self.events, self.params, self.arrival = app, request_id, events, params, arrival
        self.index, self.echo, self.prompt_ids = index, echo, list(prompt_ids)
        self.ids: list[int] = []
        self.logprobs: list[Logprob] = []
        self.new_logprobs: list[Logprob] = []  # those of the latest event
        self.shown = 0  # characters of the text already returned
        self.offset = len(echo)  # completions' text_offset of the next token whose logprobs are sent
        self.prompt_logprobs: list[Logprob | None] | None = None  # from the first event, where asked
        self.prompt_sent = not echo  # echo: the prompt's logprobs lead the first logprobs sent
        self.finish: str | None = None
        self.last: Any = None  # the latest RequestEvent
        self.first_token_at: float | None = None

    async def next_delta(self) -> str:
        """Wait for the next event; return the text it makes safe to show."""
        item = await self.events.get()
        if isinstance(item, Exception):  # the engine failed; it has already dropped the request
            self.finish = "error"
            self.app.metrics.observe_finished("error", time.monotonic() - self.arrival)
            raise item
        now = time.monotonic()
        self.last = item
        if item.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
            self.app.metrics.ttft.observe(now - self.arrival)
        self.ids += item.new_token_ids
        if item.prompt_logprobs is not None:
            self.prompt_logprobs = item.prompt_logprobs
        self.new_logprobs = list(item.logprobs or [])
        self.logprobs += self.new_logprobs
        if item.finish_reason is not None:
            self.finish = item.finish_reason
            self.app.metrics.observe_finished(item.finish_reason, now - self.arrival, item.stats.lossy)
        return self._delta()

    def _delta(self) -> str:
        text = self.params.visible_text(self.app.decode(self.ids), finished=self.finish is not None)
        delta = text[self.shown :]
        self.shown = max(self.shown, len(text))
        return delta

    def cancel(self) -> None:
        """The client is gone: abort in the engine (frees its blocks)."""
        if self.finish is None:
            self.finish = "abort"
            self.app.engine_thread.abort(self.request_id)
            self.app.metrics.observe_finished("abort", time.monotonic() - self.arrival)

    def logprobs_json(self, logprobs: Sequence[Logprob], chat: bool, token_text: Callable[[int], str]) -> Any:
        """These logprobs as the endpoint sends them; None where the request asked for none.
        Called in order over a choice's tokens (once, or once per streamed chunk)."""
        if self.params.logprobs is None:
            return None
        if chat:
            def entry(t: int, lp: float) -> dict[str, Any]:
                text = token_text(t)
                return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

            content = [entry(x.token_id, x.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in x.top]}
                       for x in logprobs]  # fmt: skip
            return {"content": content, "refusal": None}
        tokens = [token_text(x.token_id) for x in logprobs]
        offsets = []
        for t in tokens:  # each call continues where the last one's tokens ended (streamed chunks)
            offsets.append(self.offset)
            self.offset += len(t)
        body = {
            "tokens": tokens,
            "token_logprobs": [_finite(x.logprob) for x in logprobs],
            "top_logprobs": [{token_text(t): _finite(lp) for t, lp in x.top} for x in logprobs],
            "text_offset": offsets,
        }
        if not self.prompt_sent and self.prompt_logprobs is not None and self.prompt_ids:
            self.prompt_sent = True  # echo: the prompt's tokens first (the first one unscored, as OpenAI's)
            lps = self.prompt_logprobs
            texts = [token_text(t) for t in self.prompt_ids]
            body = {
                "tokens": texts + body["tokens"],
                "token_logprobs": [None if x is None else _finite(x.logprob) for x in lps] + body["token_logprobs"],
                "top_logprobs": [None if x is None else {token_text(t): _finite(v) for t, v in x.top} for x in lps]
                + body["top_logprobs"],
                "text_offset": [sum(len(t) for t in texts[:i]) for i in range(len(texts))] + body["text_offset"],
            }  # fmt: skip
        return body

    def prompt_logprobs_json(self, token_text: Callable[[int], str]) -> Any:
        """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, decoded_token}} for
        the token and its top alternatives (None for the first token)."""
        if self.prompt_logprobs is None:
            return None
        out: list[Any] = []
        for x in self.prompt_logprobs:
            if x is None:
                out.append(None)
                continue
            entries = {x.token_id: x.logprob, **dict(x.top)}
            out.append({str(t): {"logprob": _finite(lp), "decoded_token": token_text(t)} for t, lp in entries.items()})
        return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def request_usage(choices: Sequence[Choice], prompt_tokens: Sequence[int]) -> dict[str, Any]:
    """Usage over every choice: each prompt counted once (OpenAI's n; cached as far as all its
    choices found it cached), the completions and the speculation counters summed."""
    total = SpecStats()
    for c in choices:
        s = c.last.stats
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        total.num_reached_tokens += s.num_reached_tokens
        total.lossy |= s.lossy
        per = total.accepted_per_position
        per += [0] * (len(s.accepted_per_position) - len(per))
        for i, n in enumerate(s.accepted_per_position):
            per[i] += n
    outputs = sum(c.last.num_output_tokens for c in choices)
    n = max(1, len(choices) // max(1, len(prompt_tokens)))  # choices are ordered prompt × n + sample
    cached = sum(min(c.last.num_cached_tokens for c in choices[i : i + n]) for i in range(0, len(choices), n))
    return usage(dataclasses.replace(total), sum(prompt_tokens), outputs, cached)


def usage(stats: SpecStats, num_prompt_tokens: int, num_output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage (with the prompt tokens the prefix cache held) plus speculation: α
    (accepted / reached draft tokens), vLLM's draft acceptance rate (accepted / drafted) and
    τ (1 + accepted / rounds)."""
    m = RequestMetrics(**dataclasses.asdict(stats))
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "acceptance_rate": m.acceptance_rate,
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "mean_accepted_length": m.mean_accepted_length,
        "num_drafts": m.num_drafts,
        "num_draft_tokens": m.num_draft_tokens,
        "num_reached_tokens": m.num_reached_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "accepted_per_position": m.accepted_per_position,
        "lossy": stats.lossy,  # typical acceptance: the output need not follow the model's distribution
    }
