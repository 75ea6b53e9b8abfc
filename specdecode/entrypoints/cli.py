"""The `specdecode` command: `generate`, `theory`, `serve`, `train`, `audit`, `bench` and `tune`.

Owns: argument parsing, streaming text to the terminal, printing statistics, and the
error contract: bad input prints one line `error: ...` on stderr and exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, NoReturn

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.drafters.registry import parse_spec
from specdecode.entrypoints.audit import add_audit_arguments, cmd_audit
from specdecode.entrypoints.bench import add_bench_arguments, cmd_bench
from specdecode.entrypoints.theory import add_theory_arguments, cmd_theory
from specdecode.entrypoints.tune import add_tune_arguments, cmd_tune
from specdecode.entrypoints.sampling_flags import add_sampling_flags, logprobs_json, sampling_params

EXIT_BAD_INPUT = 2


QUANTIZATION_HELP = (
    "weights of the linears: auto (a GGUF's own blocks where our CPU kernel runs them, else none), none, int8, "
    "int4[-g32|-g64|-g128], gguf; add -a8 to int4 / gguf for int8 activations (llama.cpp's arithmetic: "
    "faster on AVX2 CPUs, not exact to the weights)"
)


SPEC_HELP = (
    "auto (the default: a method chosen from what the model has; the stats line says which), none (plain "
    'decoding), JSON such as \'{"method": "ngram", "num_speculative_tokens": 4}\', or @file.json'
)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--model", default=None, help="HF folder, .gguf file or alias (default: SmolLM2-135M-Instruct)")
    g.add_argument("--speculative-config", default="auto", help=SPEC_HELP)
    add_sampling_flags(g)
    g.add_argument("--dtype", default="auto", help="auto (bfloat16), float32, bfloat16, float16 (quantized weights, "
                   "e.g. the default GGUF blocks, still multiply in bfloat16; --quantization none for float32 math)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda")
    g.add_argument("--quantization", default="auto", help=QUANTIZATION_HELP)
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="compute every position alone, so speculative greedy equals plain greedy bit for bit "
                   "(default: on where our CPU kernels run; on CUDA: attention a query at a time)")
    _add_compile(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and report the speedup")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--threads", type=int, default=None, help="CPU threads, fixed (default: the cores allowed, fewer while other processes take cores)")
    _add_tensor_parallel(g)


def _add_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true", help="torch.compile the target's torch blocks, warmed up at load")
    p.add_argument("--compile-mode", default=None,
                   help="the torch.compile mode (implies --compile): default (also 'auto'), reduce-overhead "
                        "(CUDA graphs), max-autotune-no-cudagraphs, none (eager)")


def _compile(args: argparse.Namespace) -> bool | str:
    """``LLM(compile=...)`` from the flags: a mode implies --compile."""
    return args.compile_mode or args.compile


def _add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)")
    s.add_argument("--model", default=None, help="HF folder, .gguf file or alias (default: SmolLM2-135M-Instruct)")
    s.add_argument("--speculative-config", default="auto", help=SPEC_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    s.add_argument("--max-num-seqs", type=int, default=8,
                   help="requests decoded together; more wait in the queue (default: 8)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/*")
    s.add_argument("--dtype", default="auto", help="auto (bfloat16), float32, bfloat16, float16")
    s.add_argument("--device", default="auto", help="auto, cpu, cuda")
    s.add_argument("--quantization", default="auto", help=QUANTIZATION_HELP)
    s.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    s.add_argument("--max-tokens-limit", type=int, default=None,
                   help="the most max_tokens a request may ask for, and the default (default: the context)")
    s.add_argument("--max-request-bytes", type=int, default=8 << 20, help="request body limit (default: 8 MiB)")
    s.add_argument("--max-stop", type=int, default=4, help="stop strings a request may send (default: 4, OpenAI's)")
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt (default: full blocks of earlier prompts and outputs are reused)")
    _add_compile(s)
    s.add_argument("--threads", type=int, default=None, help="CPU threads, fixed (default: the cores allowed, fewer while other processes take cores)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_tensor_parallel(s)
    s.add_argument("--replicas", type=int, default=None,
                   help="run this many engine replicas on Ray Serve behind the same routes, a conversation kept on "
                        "one replica (needs: pip install 'specdecode[ray]')")
    s.add_argument("--max-replicas", type=int, default=None,
                   help="with --replicas: autoscale up to this many replicas on queue length")


def _add_tensor_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the target over this many processes (gloo on CPU, one GPU each on CUDA; "
                        "under torchrun: its processes)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    from specdecode.train.config import add_train_arguments

    add_train_arguments(sub.add_parser("train", help="train a learned drafter on a frozen target (self-distillation)"))


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors keep the CLI's contract: one line ``error: ...``, exit code 2
    (its subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    add_theory_arguments(sub.add_parser("theory", help="expected speedup (Leviathan et al.) and the verification roofline"))
    _add_serve(sub)
    _add_train(sub)
    add_audit_arguments(sub.add_parser("audit", help="check that a speculative configuration is lossless on your model"))
    add_bench_arguments(sub.add_parser("bench", help="measure which speculative configuration helps, by kind of prompt"))
    add_tune_arguments(sub.add_parser("tune", help="search the speculative configuration for your prompts, by measuring"))
    return parser


class _TextStreamer:
    """Prints text as rounds commit tokens: decoding the whole output keeps multi-byte characters
    whole, and what may still become part of a stop string waits (`SamplingParams.visible_text`)."""

    def __init__(self, llm: Any, params: SamplingParams) -> None:
        self.llm, self.params, self.out, self.shown = llm, params, [], ""

    def __call__(self, request_id: int, new_ids: list[int]) -> None:
        self.out += new_ids
        text = self.params.visible_text(self.llm.decode(self.out), finished=False)
        if len(text) > len(self.shown) and text.startswith(self.shown):
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text

    def finish(self, final_text: str) -> None:
        print(final_text[len(self.shown) :] if final_text.startswith(self.shown) else "", flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    spec = parse_spec(args.speculative_config)  # bad JSON fails before the model loads
    if args.threads is not None and args.threads < 1:
        raise SpecDecodeError(f"--threads must be >= 1, got {args.threads}")
    if args.tensor_parallel_size < 1:
        raise SpecDecodeError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    from specdecode import LLM

    llm = LLM(model=args.model, speculative_config=spec, dtype=args.dtype, device=args.device,
              quantization=args.quantization, batch_invariant=args.batch_invariant, compile=_compile(args),
              threads=args.threads, tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    prompt_ids = llm.encode_chat(args.prompt) if args.chat else llm.tokenize(args.prompt)
    if args.compare:  # the first passes of a process are cold (kernels, pages): both engines run a few rounds
        warm = llm.tokenize("Hello, world.") if llm.tokenizer is not None else prompt_ids[:1]  # not the prompt:
        for speculative in (True, False):  # a suffix drafter would remember it
            llm.generate([warm], dataclasses.replace(params, max_tokens=8), speculative=speculative)
    streamer = None if args.json else _TextStreamer(llm, params)
    out = llm.generate([prompt_ids], params, on_tokens=streamer)[0]
    if streamer is not None:
        streamer.finish(out.text)
    result: dict[str, Any] = {
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "logprobs": logprobs_json(out.logprobs, llm.decode),
        "speculative_config": llm.spec.to_dict() if llm.spec else None,
        "auto": llm.auto_choice,
        "kernels": llm.kernels,
        "batch_invariant": llm.engine.batch_invariant,
        "compile": llm.compile_mode,
        "metrics": out.metrics.to_dict(),
        "tokens_per_s": out.metrics.tokens_per_s,
    }
    if args.compare:
        base = llm.generate([prompt_ids], params, speculative=False)[0]
        result["baseline_tokens_per_s"] = base.metrics.tokens_per_s
        result["speedup"] = out.metrics.tokens_per_s / max(base.metrics.tokens_per_s, 1e-9)
        # after the first token (prefill aside): what speculation changes
        result["decode_speedup"] = out.metrics.decode_tokens_per_s / max(base.metrics.decode_tokens_per_s, 1e-9)
        result["identical"] = base.token_ids == out.token_ids if params.greedy else None
    if params.n > 1:  # the first sample streamed; the others after it, and all of them in the JSON
        result["samples"] = [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                              "logprobs": logprobs_json(c.logprobs, llm.decode)} for c in out.outputs]  # fmt: skip
        if not args.json:
            for c in out.outputs[1:]:
                print(f"\n--- sample {c.index}\n{c.text}")
    if args.json:
        print(json.dumps(result))
    else:
        _print_stats(result, llm.spec is not None)
    return 0


def _print_stats(r: dict[str, Any], speculative: bool) -> None:
    m = r["metrics"]
    lines = ["", "---"]
    if r.get("auto"):
        lines.append(r["auto"])
    if speculative:
        drafts = max(m["num_drafts"], 1)
        by_pos = ", ".join(f"{n / drafts:.2f}" for n in m["accepted_per_position"]) or "-"
        lines += [
            f"acceptance rate α: {m['acceptance_rate']:.3f}  ({m['num_accepted_tokens']} accepted of "
            f"{m['num_reached_tokens']} draft tokens reached; {m['num_draft_tokens']} drafted)",
            f"mean accepted length τ: {m['mean_accepted_length']:.2f}  over {m['num_drafts']} rounds",
            f"acceptance by position: [{by_pos}]",
        ]
        if m["lossy"]:
            lines.append("LOSSY: typical acceptance; the output is not guaranteed to follow the target's distribution")
    lines.append(f"tokens/s: {r['tokens_per_s']:.1f}  ({m['num_generated_tokens']} tokens in {m['wall_time_s']:.2f} s)")
    lines.append(f"kernels: {r['kernels']}" + (f"; torch blocks compiled ({r['compile']})" if r.get("compile") else "")
                 + ("; batch-invariant passes" if r.get("batch_invariant") else ""))  # fmt: skip
    if "speedup" in r:
        lines.append(f"plain decoding: {r['baseline_tokens_per_s']:.1f} tokens/s  speedup: {r['speedup']:.2f}x"
                     f"  (after the first token: {r['decode_speedup']:.2f}x)")
        if r["identical"] is not None:
            lines.append(f"identical to plain greedy: {'yes' if r['identical'] else 'NO'}")
    print("\n".join(lines), file=sys.stderr)  # stdout carries only the text, so it can be piped


def cmd_serve(args: argparse.Namespace) -> int:
    import socket

    from specdecode.model.compiled import parse_compile

    parse_spec(args.speculative_config)  # bad JSON fails before the model loads
    parse_compile(_compile(args))
    if not 0 <= args.port <= 65535:
        raise SpecDecodeError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_num_seqs < 1:
        raise SpecDecodeError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.api_key is not None and not args.api_key.strip():
        raise SpecDecodeError("--api-key must not be empty")
    if args.threads is not None and args.threads < 1:
        raise SpecDecodeError(f"--threads must be >= 1, got {args.threads}")
    if args.tensor_parallel_size < 1:
        raise SpecDecodeError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    try:  # a taken port fails here, in one line, rather than after loading the model
        with socket.create_server((args.host, args.port), family=socket.AF_INET6 if ":" in args.host else socket.AF_INET):
            pass
    except OSError as e:
        raise SpecDecodeError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    if args.replicas is not None:
        return _serve_replicas(args)
    from specdecode.entrypoints.serve import run_server
    from specdecode.entrypoints.server import ServerLimits

    run_server(model=args.model, speculative_config=args.speculative_config, host=args.host, port=args.port,
               max_num_seqs=args.max_num_seqs, api_key=args.api_key, dtype=args.dtype, device=args.device,
               quantization=args.quantization, max_model_len=args.max_model_len, log_level=args.log_level,
               compile=_compile(args), enable_prefix_caching=args.prefix_caching, threads=args.threads,
               tensor_parallel_size=args.tensor_parallel_size, limits=ServerLimits(max_body_bytes=args.max_request_bytes,
                                                           max_stop=args.max_stop, max_tokens_limit=args.max_tokens_limit))  # fmt: skip
    return 0


def _serve_replicas(args: argparse.Namespace) -> int:
    from specdecode.entrypoints.routing import require_ray

    if args.replicas < 1:
        raise SpecDecodeError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise SpecDecodeError(f"--max-replicas must be >= --replicas ({args.replicas}), got {args.max_replicas}")
    if args.tensor_parallel_size > 1 or _compile(args):
        raise SpecDecodeError("--replicas runs whole models: drop --tensor-parallel-size and --compile")
    require_ray()
    from specdecode.entrypoints import deploy

    options = dict(model=args.model, speculative_config=args.speculative_config, dtype=args.dtype, device=args.device,
                   quantization=args.quantization, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   threads=args.threads, enable_prefix_caching=args.prefix_caching, api_key=args.api_key,
                   replicas=args.replicas, max_replicas=args.max_replicas)  # fmt: skip
    deploy.run(options, args.host, args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "theory":
            return cmd_theory(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "audit":
            return cmd_audit(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "tune":
            return cmd_tune(args)
        if args.command == "train":
            from specdecode.train.trainer import cmd_train

            return cmd_train(args)
        return cmd_generate(args)
    except SpecDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the streamed line
        return 130
    except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, as a pipeline expects
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else Python's exit flush reports it
        return 141  # 128 + SIGPIPE: what a shell reports for a command whose reader left


if __name__ == "__main__":
    sys.exit(main())
