"""The datastore (REST-style lookup in the target's own answers, ``"datastore"`` on `eagle` and
`draft_model`): the suffix array finds the longest match and every occurrence (against brute
force), the chain is the most frequent continuation, the folder round-trips and refuses another
target; beside a model drafter greedy equals plain greedy with datastore rows seen, and sampled
output follows the target's exact joint distribution; the builder keeps each answer with its
header; bad input gets one line."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from specdecode import LLM
from specdecode.drafters.registry import parse_spec
from specdecode.config import SpecDecodeError
from specdecode.drafters.datastore import (
    EVIDENCE,
    SENTINEL,
    build_datastore,
    load_datastore,
    suffix_order,
    tokenizer_digest,
)
from specdecode.drafters.dflash_net import DFlashNet
from specdecode.drafters.eagle_net import FeatureNet
from specdecode.drafters.learned import WEIGHTS_DIR, target_fingerprint
from specdecode.drafters.medusa import MedusaNet
from specdecode.model.loader import load_model
from specdecode.train.datastore import HEADER, _ids, answer_tokens
from specdecode.train.datastore import main as build_main
from tests.drafters.test_lookup import PROMPTS, TREE, count_sources
from tests.engine.checks import assert_greedy_matches_plain, assert_samples_follow_target, greedy, sampling_target
from tests.learned import trained_folder
from tests.tiny import early_exit_checkpoint, make_tiny_checkpoint, tiny_tokenizer


def occurrences(tokens: list[int], pattern: list[int]) -> list[int]:
    """Where each occurrence of ``pattern`` ends in ``tokens`` (brute force)."""
    k = len(pattern)
    return [e for e in range(k - 1, len(tokens)) if tokens[e - k + 1 : e + 1] == pattern]


def brute_chain(tokens: list[int], ends: list[int], depth: int, min_prob: float) -> tuple[list[int], list[float]]:
    """The most frequent continuation, step by step (ties: the smaller token, a document's end first)."""
    at, chain, shares = [e + 1 for e in ends], [], []
    for _ in range(depth):
        counts = Counter(tokens[a] for a in at)
        best = max(sorted(counts), key=counts.__getitem__)
        if best == SENTINEL or counts[best] / len(ends) < min_prob:
            break
        chain.append(best)
        shares.append(counts[best] / len(ends))
        at = [a + 1 for a in at if tokens[a] == best]
    return chain, shares


def test_suffix_order_sorts_suffixes_by_their_first_depth_tokens_ties_in_position_order():
    rng = random.Random(1)
    for _ in range(200):
        seq = [rng.randrange(-1, 4) for _ in range(rng.randrange(1, 30))]
        depth = rng.choice([1, 2, 3, 5, 8, 40])
        order = suffix_order(np.array(seq), depth)
        # a list that ends sorts before any it starts; -1 (a document's end) before every token
        assert order.tolist() == sorted(range(len(seq)), key=lambda i: (seq[i : i + depth], i)), (seq, depth)


def test_suffix_order_packs_ids_of_a_large_vocabulary():
    rng = random.Random(2)
    seq = [rng.choice([-1, 0, 70_000, 262_143]) for _ in range(60)]  # 19 bits a token: 3 a key
    assert suffix_order(np.array(seq)).tolist() == sorted(range(60), key=lambda i: (seq[i : i + 8], i))


def test_match_finds_the_longest_suffix_and_all_its_occurrences():
    rng = random.Random(0)
    for _ in range(300):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(0, 12))] for _ in range(rng.randrange(1, 6))]
        if not any(docs):
            continue
        store = build_datastore(docs)
        tokens = store.tokens.tolist()
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
        n, ends = store.match(context, 5)
        longest = 0
        for k in range(1, min(5, len(context)) + 1):
            if not occurrences(tokens, context[-k:]):
                break
            longest = k
        assert n == longest, (docs, context)
        assert sorted(ends.tolist()) == (occurrences(tokens, context[-n:]) if n else [])
        if n:
            min_prob = rng.choice([0.0, 0.3, 0.6])
            chain, shares = store.chain(ends, 6, min_prob)
            want = brute_chain(tokens, ends.tolist(), 6, min_prob)
            assert chain == want[0] and np.allclose(shares, want[1]), (docs, context, min_prob)
        assert all(t != SENTINEL for e in ends.tolist() for t in tokens[e - n + 1 : e + 1])  # within a document


def test_chain_follows_the_most_frequent_continuation_to_the_end_of_a_document():
    store = build_datastore([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 6, 8], [7, 1, 2, 9]])
    n, ends = store.match([0, 1, 2], 4)
    assert n == 2 and len(ends) == 5
    # 8 ties with a document's end after 1 2 3 4 6: the chain stops
    assert store.chain(ends, 5, 0.0) == ([3, 4, 6], [0.8, 0.6, 0.4])
    assert store.chain(ends, 5, 0.5) == ([3, 4], [0.8, 0.6])
    assert store.chain(ends, 1, 0.0) == ([3], [0.8])
    assert store.match([10], 3)[0] == 0


def test_draft_takes_the_longest_match_and_gates_its_first_token():
    """n >= min_n, at most n tokens for n matched, the first token's share c / (occurrences + 1)."""
    store = build_datastore([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [9, 2, 3, 7], [8, 3, 7]])
    assert store.draft([0, 1, 2, 3], 8, 2, 0.6) == ([4, 5, 6], 3)  # 1 2 3 twice, both go on with 4: 2/3
    assert store.draft([0, 1, 2, 3], 8, 2, 0.7) == ([], 0)  # 2/3 < 0.7
    assert store.draft([0, 1, 2, 3], 2, 2, 0.6) == ([4, 5], 3)  # the depth bounds it too
    assert store.draft([0, 9, 2, 3], 8, 2, 0.5) == ([7], 3)  # one occurrence: 1/2; its document ends after 7
    assert store.draft([0, 9, 2, 3], 8, 4, 0.0) == ([], 0)  # matched 3 < min_n 4
    assert store.draft([5, 2, 3], 8, 2, 0.0) == ([4, 5], 2)  # 2 3 goes on with 4 twice, 7 once: 2 tokens for n = 2
    assert store.draft([5, 2, 3], 0, 1, 0.0) == ([], 0)


def test_a_folder_round_trips_and_refuses_another_target(tmp_path):
    fingerprint = {"architecture": "llama", "hidden_size": 8, "num_layers": 2, "vocab_size": 100}
    store = build_datastore([[1, 2, 99], [3]])
    store.save(tmp_path / "s", fingerprint)
    again = load_datastore(tmp_path / "s", fingerprint)
    assert again.tokens.tolist() == [1, 2, 99, SENTINEL, 3, SENTINEL]
    assert np.load(tmp_path / "s" / "tokens.npy").dtype == np.uint16
    with pytest.raises(SpecDecodeError, match="built for another target") as e:
        load_datastore(tmp_path / "s", {**fingerprint, "vocab_size": 50})
    assert "\n" not in str(e.value)
    with pytest.raises(SpecDecodeError, match="is not a datastore folder"):
        load_datastore(tmp_path / "missing", fingerprint)
    small = {**fingerprint, "vocab_size": 50}  # a config.json edited to another vocabulary: id 99 is outside it
    (tmp_path / "s" / "config.json").write_text(json.dumps({"specdecode_method": "datastore", "target": small}))
    with pytest.raises(SpecDecodeError, match="ids outside the vocabulary"):
        load_datastore(tmp_path / "s", small)
    with pytest.raises(SpecDecodeError, match="at least one non-empty document"):
        build_datastore([[], []])


class Vocab:
    """A stand-in tokenizer: only its vocabulary (token -> id)."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_a_folder_refuses_a_target_with_another_tokenizer(tmp_path):
    """Token ids mean something only under the tokenizer they were built with: a folder records
    its vocabulary's digest, and a target of the same shape whose tokenizer differs is refused."""
    fingerprint = {"architecture": "llama", "hidden_size": 8, "num_layers": 2, "vocab_size": 100}
    ours, other = Vocab({"a": 0, "b": 1}), Vocab({"a": 1, "b": 0})
    build_datastore([[1, 2], [3]]).save(tmp_path / "s", fingerprint, tokenizer=tokenizer_digest(ours))
    assert json.loads((tmp_path / "s" / "config.json").read_text())["tokenizer"] == tokenizer_digest(ours)
    assert load_datastore(tmp_path / "s", fingerprint, ours).num_documents == 2
    assert load_datastore(tmp_path / "s", fingerprint).num_documents == 2  # the caller knows no tokenizer
    with pytest.raises(SpecDecodeError, match="built with another tokenizer") as e:
        load_datastore(tmp_path / "s", fingerprint, other)
    assert "\n" not in str(e.value)
    build_datastore([[1, 2], [3]]).save(tmp_path / "old", fingerprint)  # a folder from before the digest
    assert load_datastore(tmp_path / "old", fingerprint, other).num_documents == 2


def test_the_digest_is_of_the_vocabulary():
    a = tokenizer_digest(Vocab({"a": 0, "b": 1}))
    assert a == tokenizer_digest(Vocab({"b": 1, "a": 0}))  # order-free
    assert a != tokenizer_digest(Vocab({"a": 1, "b": 0})) and a != tokenizer_digest(Vocab({"a": 0, "c": 1}))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, its eagle net and early-exit draft model, and a datastore of its own greedy
    answers to other prompts (so that some rows of PROMPTS find them, and some do not)."""
    root = tmp_path_factory.mktemp("datastore")
    target = make_tiny_checkpoint(root / "target", "llama", seed=0)
    model = load_model(str(target), dtype=torch.float32, device="cpu").model
    models = {"eagle": str(trained_folder(FeatureNet, model, root / "eagle", draft_vocab=0)),
              "draft_model": str(early_exit_checkpoint(target, root / "draft", 1)),
              "medusa": str(trained_folder(MedusaNet, model, root / "medusa", draft_vocab=0)),
              "dflash": str(trained_folder(DFlashNet, model, root / "dflash", steps=30, num_layers=1, block_size=4,
                                           draft_vocab=0))}  # fmt: skip
    plain = LLM(model=str(target), dtype="float32", device="cpu", speculative_config=None)
    others = [[5, 9], [7, 1, 2], [3, 3, 8], [12, 4], [6]]
    answers = [p + o.token_ids for p, o in zip(others, plain.generate(others, greedy(30)))]
    build_datastore(answers).save(root / "store", target_fingerprint(model))
    return str(target), models, plain, str(root / "store")


def count_datastore_rows(drafter, monkeypatch) -> list[int]:
    """The evidence of every datastore row proposed (wraps the drafter's propose)."""
    seen: list[int] = []
    propose = drafter.propose

    def spy(batch, num_tokens):
        draft = propose(batch, num_tokens)
        seen.extend(e for e in draft.evidence or [] if e > EVIDENCE)
        return draft

    monkeypatch.setattr(drafter, "propose", spy)
    return seen


@pytest.mark.parametrize(
    "method,shape,lookup",
    [("eagle", {}, {}), ("eagle", {}, {"prompt_lookup_max": 3}), ("draft_model", {}, {}), ("dflash", {}, {}),
     ("medusa", {}, {})],
)  # fmt: skip
def test_greedy_equals_plain(setup, monkeypatch, method, shape, lookup):
    target, models, plain, store = setup
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 4, "num_steps": 1,
            "datastore": store, "datastore_min_prob": 0.3, **lookup, **shape}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    evidence = count_datastore_rows(llm.engine.drafter, monkeypatch)
    seen = count_sources(llm.engine.drafter, monkeypatch)
    batch = []
    for max_tokens in (1, 17, 40):
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, (method, lookup))
    assert evidence and seen["model"] > 0, (evidence, seen)
    assert any(len(o.metrics.accepted_per_position) > 1 and o.metrics.accepted_per_position[1] > 0 for o in batch)


def test_ngram_with_a_datastore_equals_plain_greedy(setup, monkeypatch):
    """`ngram` drafts from the datastore where its own text has no copy (and nothing where neither has)."""
    target, _, plain, store = setup
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "datastore": store,
            "datastore_min_prob": 0.3}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    evidence = count_datastore_rows(llm.engine.drafter, monkeypatch)
    batch = assert_greedy_matches_plain(llm, plain, PROMPTS, 40, "ngram")
    assert evidence and sum(o.metrics.num_accepted_tokens for o in batch) > 0


def test_a_tree_takes_datastore_rows_as_chains(setup, monkeypatch):
    target, models, plain, store = setup
    spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 4, "num_steps": 2,
            "datastore": store, "datastore_min_prob": 0.3, **TREE}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    seen = count_sources(llm.engine.drafter, monkeypatch)
    assert_greedy_matches_plain(llm, plain, PROMPTS, 40, "tree")
    assert seen["lookup"] > 0 and seen["model"] > 0, seen


@pytest.mark.parametrize("method", ["eagle", "draft_model", "ngram"])
def test_sampled_joint_distribution_matches_target(tmp_path, monkeypatch, method):
    target = sampling_target(tmp_path / "t")
    model = load_model(str(target), dtype=torch.float32, device="cpu").model
    if method == "eagle":
        drafter = trained_folder(FeatureNet, model, tmp_path / "net", steps=20, draft_vocab=5)  # q = 0 on one token
    elif method == "draft_model":
        drafter = make_tiny_checkpoint(tmp_path / "d", "llama", seed=5, logit_scale=0.5, vocab_size=6)
    rng = random.Random(3)  # random text over the 6 tokens: every 2-gram occurs, continuations disagree
    build_datastore([[rng.randrange(6) for _ in range(40)] for _ in range(5)]).save(
        tmp_path / "s", target_fingerprint(model)
    )
    spec = {"method": method, "num_speculative_tokens": 2, "datastore": str(tmp_path / "s"),
            "datastore_min_prob": 0.25, "prompt_lookup_min": 2}  # fmt: skip
    if method != "ngram":
        spec |= {"model": str(drafter), "num_steps": 1}
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu")
    evidence = count_datastore_rows(llm.engine.drafter, monkeypatch)
    seen = count_sources(llm.engine.drafter, monkeypatch) if method != "ngram" else {"model": 1}
    assert_samples_follow_target(llm, 3, 1.0, 0)
    assert evidence and seen["model"] > 0, (len(evidence), seen)


def test_the_builder_keeps_each_answer_with_its_header(tmp_path):
    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "ok"}]  # fmt: skip
    turns = answer_tokens(messages, tok)
    assert len(turns) == 2
    for i, turn in zip((1, 3), turns):
        before = _ids(tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True))
        through = _ids(tok.apply_chat_template(messages[: i + 1], tokenize=True))
        assert turn == through[len(before) - HEADER :]
        assert tok.decode(turn).find(messages[i]["content"]) >= 0


def test_the_builder_writes_a_folder_and_refuses_bad_input(tmp_path, capsys):
    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=0)
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
               for i in range(3)]  # fmt: skip
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert build_main(["--data", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "s"), "--target", str(target)]) == 0
    loaded = load_model(str(target), dtype=torch.float32, device="cpu")
    assert load_datastore(tmp_path / "s", target_fingerprint(loaded.model), loaded.tokenizer).num_documents == 3
    assert json.loads((tmp_path / "s" / "config.json").read_text())["tokenizer"] == tokenizer_digest(loaded.tokenizer)
    # --drop-held-out skips a record whose request names a benchmark subject (here "what to pack")
    near = {"messages": [{"role": "user", "content": "Not sure what to pack for Peru."},
                         {"role": "assistant", "content": "a hat"}]}  # fmt: skip
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in [*records, near]) + "\n")
    for flag, documents in (([], 4), (["--drop-held-out"], 3)):
        out = tmp_path / f"s{len(flag)}"
        assert build_main(["--data", str(tmp_path / "b.jsonl"), "--out", str(out), "--target", str(target), *flag]) == 0
        assert load_datastore(out, target_fingerprint(loaded.model), loaded.tokenizer).num_documents == documents
    (tmp_path / "bad.jsonl").write_text('{"text": "plain text"}\n')
    (tmp_path / "a_file").write_text("")
    capsys.readouterr()
    for data, out, message in (
        (tmp_path / "missing", "x", "data path not found"),
        (tmp_path / "bad.jsonl", "x", "expected a JSON chat record"),
        (tmp_path / "a.jsonl", "a_file", "cannot write --out"),
    ):
        assert build_main(["--data", str(data), "--out", str(tmp_path / out), "--target", str(target)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "extra,message",
    [({"datastore": ""}, "datastore must be a folder path or true"), ({"datastore": 3}, "datastore must be"),
     ({"datastore": True, "datastore_min_prob": 1.5}, r"datastore_min_prob must be a number in \[0, 1\]"),
     ({"datastore": True, "prompt_lookup_min": 9, "prompt_lookup_max": 9}, "prompt_lookup_min must be <= 8"),
     ({"datastore_min_prob": 0.5}, "datastore_min_prob needs datastore"),
     ({"datastore": False, "datastore_min_prob": 0.5}, "datastore_min_prob needs datastore")],
)  # fmt: skip
@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_bad_options_get_one_line(method, extra, message):
    with pytest.raises(SpecDecodeError, match=message) as e:
        parse_spec({"method": method, "num_speculative_tokens": 4, **extra})
    assert "\n" not in str(e.value)


def test_ngram_takes_a_datastore_for_chains_only():
    with pytest.raises(SpecDecodeError, match="datastore drafts chains: it needs max_matches 1"):
        parse_spec({"method": "ngram", "num_speculative_tokens": 4, "max_matches": 2, "datastore": True})


def test_a_missing_or_foreign_datastore_gets_one_line(setup, tmp_path):
    target, models, _, _ = setup
    other = {"architecture": "llama", "hidden_size": 8, "num_layers": 2, "vocab_size": 100}
    build_datastore([[1, 2]]).save(tmp_path / "other", other)
    cases = [(True, "no datastore ships for"), (str(tmp_path / "nope"), "is not a datastore folder"),
             (str(tmp_path / "other"), "built for another target")]  # fmt: skip
    for store, message in cases:
        spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 2, "datastore": store}
        with pytest.raises(SpecDecodeError, match=message) as e:
            LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
        assert "\n" not in str(e.value)


def test_the_shipped_datastore_loads_for_the_default_model():
    """The package's datastore (the default model's greedy answers) is whole: its tokens within the
    vocabulary its config.json names, every answer ended, and the default model's chat header found."""
    folder = WEIGHTS_DIR / "smollm2-135m-datastore"
    meta = json.loads((folder / "config.json").read_text())
    store = load_datastore(folder, meta["target"])
    assert store.num_documents == meta["documents"] > 1000 and len(store) == meta["tokens"]
    assert store.match([1, 520, 9531, 198], 8)[0] == 3  # "<|im_start|>assistant\n" opens every answer
