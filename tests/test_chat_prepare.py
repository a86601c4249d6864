"""`trident data prepare --chat`: conversations rendered with the tokenizer folder's chat
template (as `transformers` renders and tokenizes it), and the loss mask beside them in
Megatron's format, 1 on the assistant's tokens only, with the same document boundaries."""

from __future__ import annotations

import pytest

from service.files import corpus
from service.files.chat_prepare import mask_prefix, prepare_chat
from service.files.tokenizer import PrepareError
from tests.tokenizer_folders import CONVERSATIONS, make, vocab, write_chats


def test_chat_corpus_and_its_loss_mask(tmp_path):
    from transformers import AutoTokenizer

    folder = make(tmp_path / "tok")
    prefix = str(tmp_path / "chat")
    s = prepare_chat([write_chats(tmp_path / "c.jsonl")], str(folder), prefix)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    v = vocab()
    tokens, masks = corpus.Corpus(prefix), corpus.Corpus(mask_prefix(prefix))
    assert masks.header.dtype.__name__ == "uint8"
    assert masks.lengths.tolist() == tokens.lengths.tolist()
    assert masks.boundaries.tolist() == tokens.boundaries.tolist() == [0, 1, 2]
    for i, conv in enumerate(CONVERSATIONS):
        ids, mask = tokens[i].tolist(), masks[i].tolist()
        # The tokens are transformers' own tokenizing of the template, then EOS.
        assert ids == list(hf.apply_chat_template(conv, tokenize=True,
                                                  return_dict=True)["input_ids"]) + [v["</s>"]]
        assert ids[0] == v["<s>"]
        # Exactly the assistant's words and the end of their turns train.
        trained = [hf.convert_ids_to_tokens(t) for t, m in zip(ids, mask, strict=True) if m]
        answers = [m["content"].split() + ["<|end|>"] for m in conv if m["role"] == "assistant"]
        assert trained == [w for a in answers for w in a]
    assert s.specials["trained_tokens"] == 3 + 2 + 3
    from service.files import corpus_scan

    meta = corpus_scan.read_meta(prefix)
    assert meta is not None and meta.tokens == tokens.header.tokens
    assert meta.max_token == max(max(tokens[i].tolist()) for i in range(2))
    assert "loss mask " + prefix + "_loss_mask: 8 tokens train" in s.line()


def test_chat_refusals_name_the_line(tmp_path):
    folder = make(tmp_path / "tok")
    out = str(tmp_path / "o")
    cases = [
        ('{"messages": [{"role": "user", "content": "hello"}]}', "c.jsonl:1: no assistant"),
        ('{"text": "hello"}', "c.jsonl:1: no 'messages' list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages\\[0\\].role 'robot'"),
        ('{"messages": [{"role": "user"}]}', "messages\\[0\\] has no text 'content'"),
        ("{", "c.jsonl:1: not JSON"),
    ]
    for line, words in cases:
        (tmp_path / "c.jsonl").write_text(line + "\n")
        with pytest.raises(PrepareError, match=words):
            prepare_chat([str(tmp_path / "c.jsonl")], str(folder), out)
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o_loss_mask.bin.tmp").exists()
    plain = make(tmp_path / "plain", chat=False)
    with pytest.raises(PrepareError, match="has no chat_template"):
        prepare_chat([write_chats(tmp_path / "c.jsonl")], str(plain), out)
    with pytest.raises(PrepareError, match="needs a tokenizer folder"):
        prepare_chat([write_chats(tmp_path / "c.jsonl")], "gpt2", out)
    odd = make(tmp_path / "odd", config={"chat_template": (
        "{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}")})
    with pytest.raises(PrepareError, match="cannot be told apart"):
        prepare_chat([write_chats(tmp_path / "c.jsonl")], str(odd), out)


def test_cli_prepare_chat_and_inspect(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    folder = make(tmp_path / "tok")
    prefix = str(tmp_path / "chat")
    r = CliRunner().invoke(app, ["data", "prepare", write_chats(tmp_path / "c.jsonl"),
                                 "--chat", "--tokenizer", str(folder), "--out", prefix])
    assert r.exit_code == 0, r.output
    assert "2 documents" in r.output and "8 tokens train" in r.output
    r = CliRunner().invoke(app, ["data", "inspect", prefix, "--tokenizer", str(folder)])
    assert r.exit_code == 0, r.output
    total = corpus.read_header(prefix).tokens
    assert f"loss mask {prefix}_loss_mask: 8 of {total} tokens train" in r.output
