"""The sampling flags of `specdecode generate`, in vLLM's names, and the `SamplingParams` they make.

Owns: the flags and their parsing into one validated `SamplingParams` (bad values are the
params' one-line errors, exit 2); the logprobs of a result as JSON.
Does not own: the other flags or the command itself (cli.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.core.sampling import Logprob


def add_sampling_flags(g: argparse.ArgumentParser) -> None:
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 (or -1, as vLLM) = off")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="keep the smallest set of tokens with this much mass; 1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest's probability")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--n", type=int, default=1, help="independent samples of the prompt")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=[], help="token ids that end generation like EOS")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0, help="hold EOS and stop token ids back until this many tokens")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], once per token in the output")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], per occurrence in the output")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; > 1 makes tokens of the prompt and output less likely")
    g.add_argument("--logit-bias", default=None, help='JSON {token id: bias in [-100, 100]}, e.g. \'{"50256": -100}\'')
    g.add_argument("--bad-words", action="append", default=[], help="a word never to complete (repeatable)")
    g.add_argument("--allowed-token-ids", type=int, nargs="+", default=None, help="the only token ids to sample")
    g.add_argument("--logprobs", type=int, default=None,
                   help="report each output token's logprob and this many alternatives (--json)")
    g.add_argument("--logprobs-mode", default="raw_logprobs", help="raw_logprobs (the model's) or processed_logprobs")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    bias = None
    if args.logit_bias is not None:
        try:
            bias = json.loads(args.logit_bias)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"--logit-bias is not valid JSON: {e.msg} at char {e.pos}") from None
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed, n=args.n, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, logit_bias=bias, bad_words=tuple(args.bad_words),
        allowed_token_ids=args.allowed_token_ids, logprobs=args.logprobs, logprobs_mode=args.logprobs_mode,
    )  # fmt: skip


def logprobs_json(logprobs: list[Logprob] | None, token_text: Callable[[list[int]], str]) -> Any:
    if logprobs is None:
        return None
    return [{"token_id": x.token_id, "token": token_text([x.token_id]), "logprob": x.logprob,
             "top": [{"token_id": t, "token": token_text([t]), "logprob": lp} for t, lp in x.top]}
            for x in logprobs]  # fmt: skip
