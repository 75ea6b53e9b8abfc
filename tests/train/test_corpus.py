"""The corpus: documents found recursively, .jsonl text and chat records, a held-out split
by document that depends only on the seed, the token cap, and windows padded at the right."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.train.corpus import Tokenized, _answer_spans, pack, read_corpus
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
    c = read_corpus((str(tmp_path),), tok, seq_len=32, max_tokens=10_000, heldout=0.25, seed=0)
    assert c.num_files == 10 and c.num_documents == 11  # 9 .md + 2 records; .bin ignored
    eos = tok.eos_token_id
    everything = torch.cat([c.train.tokens[c.train.mask], c.heldout.tokens[c.heldout.mask]]).tolist()
    text = tok.decode([t for t in everything if t != eos])
    assert "<user>hi\n<assistant>yo\n" in text and "plain record" in text
    assert (
        everything.count(eos) == 11 and c.heldout.tokens[c.heldout.mask].tolist()[-1] == eos
    )  # whole documents held out
    again = read_corpus((str(tmp_path),), tok, seq_len=32, max_tokens=10_000, heldout=0.25, seed=0)
    assert torch.equal(again.heldout.tokens, c.heldout.tokens)
    other = read_corpus((str(tmp_path),), tok, seq_len=32, max_tokens=10_000, heldout=0.25, seed=1)
    assert not torch.equal(other.heldout.tokens, c.heldout.tokens)
    capped = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=70, heldout=0.25, seed=0)
    kept = torch.cat([capped.train.tokens[capped.train.mask], capped.heldout.tokens[capped.heldout.mask]])
    assert len(kept) <= 70 and capped.num_documents >= 2
    assert int((kept == eos).sum()) == capped.num_documents  # whole documents: the cap cuts none


def test_the_cap_does_not_leave_a_scrap_held_out(tmp_path):
    """The held-out side is the last documents: a cap that cut the last one left a few tokens
    to evaluate on (3 of a corpus of 12k), or "corpus too small" one token earlier."""
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 10)  # 110 characters + EOS each
    tok = tiny_tokenizer()
    for cap in (333, 334, 335, 400):  # 111 tokens a document
        c = read_corpus((str(tmp_path),), tok, seq_len=16, max_tokens=cap, heldout=0.3, seed=0)
        assert c.num_documents == 3 and c.heldout.num_tokens == 111 and c.train.num_tokens == 222


def test_chat_records_get_the_special_tokens_of_inference(tmp_path):
    """A chat template that writes BOS itself: the record starts with one BOS, as
    `LLM.encode_chat` gives (the tokenizer added a second)."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "plain.txt").write_text("plain text here")
    c = read_corpus((str(tmp_path),), tok, seq_len=64, max_tokens=1000, heldout=0.5, seed=0)
    ids = [c.train.tokens[c.train.mask].tolist(), c.heldout.tokens[c.heldout.mask].tolist()]
    served = tok.apply_chat_template(record["messages"], tokenize=True)
    served = list(served["input_ids"] if isinstance(served, dict) or hasattr(served, "keys") else served)
    assert served[:2] != [bos, bos] and served[0] == bos
    chat = next(d for d in ids if tok.decode(d).find("yo") >= 0)
    assert chat == list(served) + [tok.eos_token_id]
    plain = next(d for d in ids if d is not chat)
    assert plain[0] == bos and plain[1] != bos  # plain text keeps the tokenizer's BOS


def test_a_training_document_that_quotes_a_held_out_one_is_dropped(tmp_path):
    """regenerate --passages quotes an earlier answer in a prompt ("Summarize ...:\n\n<answer>"):
    whichever side of the split each lands on, the training side must not hold the other's text."""
    tok = tiny_tokenizer()
    answers = [f"answer {i}: " + " ".join(f"word{i}{j}" for j in range(60)) for i in range(6)]
    system = {"role": "system", "content": "You are a helpful assistant. " * 12}  # 348 characters, in every record
    chats = [
        {"messages": [system, {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": a}]}
        for i, a in enumerate(answers)
    ]
    quotes = [
        {"messages": [system, {"role": "user", "content": f"Summarize the following text:\n\n{a}"},
                      {"role": "assistant", "content": f"short {i}"}]}
        for i, a in enumerate(answers)
    ]  # fmt: skip
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in chats) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in quotes) + "\n")
    for seed in range(4):
        c = read_corpus((str(tmp_path),), tok, seq_len=1024, max_tokens=100_000, heldout=0.3, seed=seed)
        train = tok.decode(c.train.tokens[c.train.mask].tolist())
        held = tok.decode(c.heldout.tokens[c.heldout.mask].tolist())
        shared = [a for a in answers if a in train and a in held]
        assert not shared, f"seed {seed}: {len(shared)} answers on both sides"
        assert c.train.num_tokens > 0 and any(a in held for a in answers)
        assert 0 < c.num_dropped < 12 and c.num_documents == 12 - c.num_dropped  # a shared system prompt is no quote


def test_single_document_holds_out_its_tail(tmp_path):
    (tmp_path / "one.txt").write_text("abcdefghij" * 10)
    c = read_corpus((str(tmp_path / "one.txt"),), tiny_tokenizer(), seq_len=32, max_tokens=1000, heldout=0.1, seed=0)
    assert c.num_documents == 1 and c.heldout.num_tokens == 10 and c.train.num_tokens == 91


def test_pack_starts_each_window_at_a_document():
    """Whole documents while they fit; a longer one fills windows of its own and its rest starts
    the next; padding at the right. (Windows cut anywhere started mid-answer: the target's
    logits there missed the prompt serving has.)"""
    docs = [Tokenized([1, 2, 3], [True, True, False]), Tokenized([4, 5], [False, True]),
            Tokenized(list(range(6, 16)), [True] * 9 + [False]), Tokenized([16], [True])]  # fmt: skip
    w = pack(docs, 4)
    assert w.tokens.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16, 0]]
    assert w.mask.tolist()[0] == [True, True, True, False] and w.num_tokens == 16
    assert w.trained.tolist() == [[True, True, False, False], [False, True, False, False], [True] * 4, [True] * 4,
                                  [True, False, True, False]]  # fmt: skip


@pytest.mark.parametrize("turn_end,stops,answers", [
    ("</s>", (), "yo</s>ok</s>"),  # the tokenizer's EOS ends the turn
    ("<unk>", (3,), "yo<unk>ok<unk>"),  # Gemma: <end_of_turn> ends it, a stop id of the target's (generation_config)
    ("<unk>", (), "yo<unk>\nok<unk>\n"),  # no stop token in the turn: all the template writes for it
])  # fmt: skip
def test_a_chat_record_trains_where_the_assistant_writes(tmp_path, turn_end, stops, answers):
    """The positions trained on are those whose next token the assistant wrote, through the stop
    token that ends its turn (not what the template writes after it), in every assistant turn;
    the system and user turns are context. Plain text trains everywhere but its last token (EOS)."""
    tok = tiny_tokenizer()
    assert tok.convert_tokens_to_ids("<unk>") == 3
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                         + turn_end + "\n{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "ok"}]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    (tmp_path / "plain.txt").write_text("plain text")
    c = read_corpus((str(tmp_path),), tok, seq_len=128, max_tokens=1000, heldout=0.5, seed=0, stop_ids=stops)
    assert c.num_whole == 0
    for w in (c.train, c.heldout):
        ids = w.tokens[w.mask].tolist()
        trained = w.trained[w.mask].tolist()
        labels = tok.convert_ids_to_tokens([ids[t + 1] for t in range(len(ids) - 1) if trained[t]])
        if "yo" in tok.decode(ids):
            assert "".join(labels).replace("Ċ", "\n") == answers
        else:
            assert "".join(labels) == "lain text</s>" and not trained[-1]  # each token after the first


def test_a_template_that_renders_turns_otherwise_trains_on_the_whole_record(tmp_path):
    """A template whose earlier turns read differently inside the whole conversation (one that
    drops earlier reasoning, say) gives no answer spans: the whole record is trained on."""
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] if loop.last else '-' }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    c = read_corpus((str(tmp_path),), tok, seq_len=64, max_tokens=1000, heldout=0.5, seed=0)
    assert c.train.num_trained == c.train.num_tokens - 1 and c.num_whole == 2  # counted: train_log.json says so


def test_a_turn_rendered_otherwise_in_the_whole_conversation_is_context():
    """Qwen3-style: an earlier assistant turn reads otherwise once later turns follow (its
    reasoning dropped), so it is not what serving generated then: only the last turn is learned."""
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] if (loop.last or m['role'] != "
                         "'assistant') else '-' }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "ok"}]  # fmt: skip
    rendered = tok.apply_chat_template(messages, tokenize=False)
    spans = _answer_spans(messages, rendered, tok)
    assert [rendered[a:b] for a, b in spans] == ["ok\n"]


def test_a_long_record_continues_with_half_a_window_of_context_and_empty_windows_go():
    """A chat record longer than a window: each later window repeats the half window before it,
    untrained, so an answer's labels are never computed from a window that starts on them; plain
    text continues in consecutive pieces; a window with nothing to learn is left out."""
    chat = Tokenized(list(range(1, 11)), [False, False] + [True] * 7 + [False], context=True)
    prompt_only = Tokenized([20, 21, 22, 23], [False] * 4, context=True)
    w = pack([chat, prompt_only], 4)
    assert w.tokens.tolist() == [[1, 2, 3, 4], [3, 4, 5, 6], [5, 6, 7, 8], [7, 8, 9, 10]]
    assert w.trained.tolist() == [[False, False, True, True], [False, False, True, True],
                                  [False, False, True, True], [False, False, True, False]]  # fmt: skip
    plain = pack([Tokenized(list(range(1, 11)), [True] * 9 + [False])], 4)
    assert plain.tokens.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]


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
