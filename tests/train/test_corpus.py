"""The corpus: documents found recursively, .jsonl text and chat records, a held-out split
by document that depends only on the seed, the token cap, and windows padded at the right."""

from __future__ import annotations

import json

import torch

from specdecode.train.corpus import pack, read_corpus
from tests.tiny import tiny_tokenizer


def test_documents_jsonl_chat_split_and_cap(tmp_path):
    tok = tiny_tokenizer()
    (tmp_path / "sub").mkdir()
    for i in range(9):
        (tmp_path / "sub" / f"{i}.md").write_text(f"doc {i} " * 5)
    (tmp_path / "skip.bin").write_text("not text")
    records = [
        {"text": "plain record"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    c = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=10_000, heldout=0.25, seed=0)
    assert c.num_files == 10 and c.num_documents == 11  # 9 .md + 2 records; .bin ignored
    eos = tok.eos_token_id
    everything = torch.cat([c.train.tokens[c.train.mask], c.heldout.tokens[c.heldout.mask]]).tolist()
    text = tok.decode([t for t in everything if t != eos])
    assert "<user>hi\n<assistant>yo\n" in text and "plain record" in text
    assert (
        everything.count(eos) == 11 and c.heldout.tokens[c.heldout.mask].tolist()[-1] == eos
    )  # whole documents held out
    again = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=10_000, heldout=0.25, seed=0)
    assert torch.equal(again.heldout.tokens, c.heldout.tokens)
    other = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=10_000, heldout=0.25, seed=1)
    assert not torch.equal(other.heldout.tokens, c.heldout.tokens)
    capped = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=50, heldout=0.25, seed=0)
    assert capped.train.num_tokens + capped.heldout.num_tokens == 50


def test_single_document_holds_out_its_tail(tmp_path):
    (tmp_path / "one.txt").write_text("abcdefghij" * 10)
    c = read_corpus((str(tmp_path / "one.txt"),), tiny_tokenizer(), seq_len=32, max_tokens=1000, heldout=0.1, seed=0)
    assert c.num_documents == 1 and c.heldout.num_tokens == 10 and c.train.num_tokens == 91


def test_pack_pads_the_last_window():
    w = pack(list(range(1, 11)), 4)
    assert w.tokens.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert w.mask.sum() == 10 and not w.mask[2, 2:].any()


def test_a_file_named_twice_is_read_once_and_one_document_always_trains(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 20)
    tok = tiny_tokenizer()
    once = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=10_000, heldout=0.3, seed=0)
    twice = read_corpus((str(tmp_path), f"{tmp_path}/./", str(tmp_path / "0.txt")), tok, seq_len=16,
                        max_tokens=10_000, heldout=0.3, seed=0)  # fmt: skip
    assert twice.num_files == once.num_files == 3 and torch.equal(twice.heldout.tokens, once.heldout.tokens)
    most = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=10_000, heldout=0.99, seed=0)
    eos = tok.eos_token_id
    assert int((most.train.tokens[most.train.mask] == eos).sum()) == 1  # 0.99 of 3 documents: 2 held out
    assert int((most.heldout.tokens[most.heldout.mask] == eos).sum()) == 2
