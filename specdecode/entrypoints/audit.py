"""`specdecode audit`: prove on your own model and prompts that a speculative configuration is
lossless.

Owns: the two checks and their report. Greedy: every prompt's speculative output equals
plain decoding's token for token. Sampling: at each temperature, many seeded samples with and
without speculation (the prompts in turn; disjoint seeds: independent samples); at each output position a
two-sample chi-square test on the token's distribution (the likeliest tokens, the rest pooled
into one bucket), its p-value against a threshold, and its power: the smallest total-variation
distance between the two laws that it would detect with probability 0.8. Exit code 1 on any
failure. Lossless speculation makes the joint law of the output identical, so every
position's marginal is too; a biased verifier shows up as a failed position.
Does not own: decoding (`LLM`) or the command line's parsing (cli.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.entrypoints.bench_prompts import read_prompts_file

DEFAULT_PROMPTS = [
    "Explain in a short paragraph why the sky looks blue during the day.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarise: The committee met on Tuesday to review the budget. It approved the new library "
    "and postponed the decision on the swimming pool until spring.",
    "List three uses of a paperclip.",
]
SEED_OFFSET = 1_000_003  # the plain arm's seeds (torch seeds its CPU generator with their low 32 bits)


@dataclass
class PositionTest:
    position: int
    pvalue: float
    detectable_tv: float  # the smallest TV distance detected with probability 0.8 at this size
    passed: bool
    categories: int


@dataclass
class AuditReport:
    greedy_identical: list[bool] = field(default_factory=list)
    sampling: dict[float, list[PositionTest]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.greedy_identical) and all(t.passed for ts in self.sampling.values() for t in ts)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "greedy_identical": self.greedy_identical,
                "sampling": {str(t): [vars(x) for x in ts] for t, ts in self.sampling.items()}}  # fmt: skip


def read_prompts(path: str | None) -> list[Any]:
    """Prompts from a .jsonl file (chat messages, or a raw prompt's text: bench_prompts.py reads
    it), else the built-in ones (chat messages)."""
    if path is None:
        return [[{"role": "user", "content": p}] for p in DEFAULT_PROMPTS]
    return [p.text if p.text is not None else p.messages for p in read_prompts_file(path)]


def token_ids(llm: Any, prompt: Any) -> list[int]:
    """A prompt's ids: text, token ids, or chat messages through the model's template."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return llm.tokenize(prompt)
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise SpecDecodeError("chat prompts need a model with a chat template; give {\"prompt\": \"...\"} lines")
    ids = llm.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def two_sample_test(a: list[int], b: list[int], alpha: float) -> PositionTest:
    """Chi-square on two samples of tokens: categories with an expected count >= 5 in each arm,
    the rest in one bucket. The power is computed for moving mass between the two commonest
    categories (the shift a biased verifier makes first), from the non-central chi-square."""
    from collections import Counter

    from scipy.stats import chi2, chi2_contingency, ncx2

    n = min(len(a), len(b))
    ca, cb = Counter(a), Counter(b)
    pooled = Counter(a) + Counter(b)
    common = [t for t, c in pooled.most_common() if c / 2 >= 5]
    rows = [[ca[t] for t in common], [cb[t] for t in common]]
    rest = [len(a) - sum(rows[0]), len(b) - sum(rows[1])]
    if sum(rest) > 0:
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    if len(rows[0]) < 2:  # one category: the two samples cannot differ
        return PositionTest(0, 1.0, 0.0, True, len(rows[0]))
    pvalue = float(chi2_contingency(rows, correction=False).pvalue)
    df = len(rows[0]) - 1
    crit = chi2.ppf(1 - alpha, df)
    p = [pooled[t] / (len(a) + len(b)) for t in common[:2]] if len(common) >= 2 else [0.5, 0.5]
    lo, hi = 0.0, 1.0  # bisect the TV distance d whose shift gives power 0.8: λ = (n / 2) d² (1/p1 + 1/p2)
    for _ in range(50):
        d = (lo + hi) / 2
        power = 1 - ncx2.cdf(crit, df, n / 2 * d * d * (1 / p[0] + 1 / p[1]))
        lo, hi = (lo, d) if power >= 0.8 else (d, hi)
    return PositionTest(0, pvalue, hi, pvalue >= alpha, len(rows[0]))


def run_audit(llm: Any, prompts: list[Any], temperatures: list[float], samples: int, positions: int,
              max_tokens: int, alpha: float = 0.01, progress: Any = None) -> AuditReport:  # fmt: skip
    """Greedy equality over ``prompts`` (``max_tokens`` each); then, per temperature, ``samples``
    seeded continuations of ``positions`` tokens (the prompts in turn) with and without
    speculation, tested position by position at level ``alpha``."""
    report = AuditReport()
    ids = [token_ids(llm, p) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for prompt in ids:
        spec, plain = llm.generate([prompt], greedy)[0], llm.generate([prompt], greedy, speculative=False)[0]
        report.greedy_identical.append(spec.token_ids == plain.token_ids)
        if progress is not None:
            progress(f"greedy: {'identical' if report.greedy_identical[-1] else 'DIFFERENT'}")
    for t in temperatures:
        def draw(speculative: bool, offset: int) -> list[list[int]]:
            params = [SamplingParams(temperature=t, max_tokens=positions, seed=offset + s, ignore_eos=True)
                      for s in range(samples)]  # fmt: skip
            # sample s continues prompt s mod len(prompts) in both arms: the same mixture of prompts
            prompts_s = [ids[s % len(ids)] for s in range(samples)]
            return [o.token_ids for o in llm.generate(prompts_s, params, speculative=speculative)]

        spec, plain = draw(True, 0), draw(False, SEED_OFFSET)
        tests = []
        for k in range(positions):
            test = two_sample_test([o[k] for o in spec if len(o) > k], [o[k] for o in plain if len(o) > k], alpha)
            test.position = k + 1
            tests.append(test)
        report.sampling[t] = tests
        if progress is not None:
            progress(f"T={t}: " + ", ".join(f"pos {x.position} p={x.pvalue:.3f}" for x in tests))
    return report


def add_audit_arguments(a: Any) -> None:
    a.add_argument("--speculative-config", required=True, help="the configuration to audit (JSON)")
    a.add_argument("--model", default=None, help="HF folder, .gguf file or alias (default: SmolLM2-135M-Instruct)")
    a.add_argument("--prompts", default=None, help='a .jsonl of {"messages": [...]} or {"prompt": "..."} (default: built in)')
    a.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    a.add_argument("--samples", type=int, default=500, help="seeded samples per arm and temperature")
    a.add_argument("--positions", type=int, default=3, help="output positions tested under sampling")
    a.add_argument("--max-tokens", type=int, default=64, help="tokens compared under greedy decoding")
    a.add_argument("--alpha", type=float, default=0.01, help="the tests' level")
    a.add_argument("--dtype", default="auto")
    a.add_argument("--device", default="auto")
    a.add_argument("--quantization", default="auto")
    a.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_audit(args: Any) -> int:
    from specdecode.drafters.registry import parse_spec
    from specdecode.entrypoints.llm import LLM

    for name, low, high in (("samples", 20, SEED_OFFSET - 1), ("positions", 1, 64), ("max_tokens", 1, 1 << 20)):
        if not low <= getattr(args, name) <= high:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be in [{low}, {high}], got {getattr(args, name)}")
    if not 0 < args.alpha < 1 or any(t <= 0 for t in args.temperatures):
        raise SpecDecodeError("--alpha must be in (0, 1) and every --temperatures value > 0")
    spec = parse_spec(args.speculative_config)
    if spec is None:
        raise SpecDecodeError("--speculative-config: give the configuration to audit (not none)")
    prompts = read_prompts(args.prompts)
    llm = LLM(model=args.model, speculative_config=spec, dtype=args.dtype, device=args.device,
              quantization=args.quantization)  # fmt: skip
    say = None if args.json else (lambda line: print(line, flush=True))
    report = run_audit(llm, prompts, args.temperatures, args.samples, args.positions, args.max_tokens, args.alpha, say)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        worst = max((x.detectable_tv for ts in report.sampling.values() for x in ts), default=0.0)
        print(f"{'PASS' if report.passed else 'FAIL'}: greedy identical on {sum(report.greedy_identical)}/"
              f"{len(report.greedy_identical)} prompts; sampling tests at level {args.alpha} would detect a "
              f"total-variation distance of {worst:.3f} with probability 0.8")  # fmt: skip
    return 0 if report.passed else 1
