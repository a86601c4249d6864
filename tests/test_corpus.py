"""The corpus format against Megatron itself: a corpus megatron-core's builder writes reads back
through Trident's reader, one `trident data prepare` writes reads back through megatron-core's
`IndexedDataset`, and the header checks name each file and reason."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from service.files import corpus, corpus_scan
from service.files.corpus_prepare import PrepareError, inspect, prepare
from service.files.tokenizer import Gpt2


def _megatron():
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def _megatron_corpus(prefix: str, dtype=np.uint16, docs=None) -> list[list[list[int]]]:
    """A corpus written by megatron-core's builder: documents of one or more sequences."""
    rng = np.random.default_rng(0)
    docs = docs if docs is not None else [
        [rng.integers(0, 50000, int(rng.integers(1, 40))).tolist()
         for _ in range(int(rng.integers(1, 4)))] for _ in range(25)]
    m = _megatron()
    builder = m.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.tensor(seq, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_written_corpus_reads_through_trident(tmp_path, dtype):
    prefix = str(tmp_path / "meg")
    docs = _megatron_corpus(prefix, dtype)
    seqs = [s for d in docs for s in d]
    c = corpus.Corpus(prefix)
    h = c.header
    assert (h.sequences, h.documents, h.tokens) == (len(seqs), len(docs), sum(map(len, seqs)))
    assert h.dtype is dtype
    assert [c[i].tolist() for i in range(len(c))] == seqs
    # Document boundaries: the first sequence index of each document, then the count.
    bounds = np.cumsum([0] + [len(d) for d in docs]).tolist()
    assert c.boundaries.tolist() == bounds
    assert c.get(0, 1, 2).tolist() == seqs[0][1:3]
    # And Megatron agrees with itself on what Trident read.
    m = _megatron().IndexedDataset(prefix)
    assert [m[i].tolist() for i in range(len(m))] == seqs


def test_prepared_corpus_reads_through_megatron(tmp_path):
    texts = ["The quick brown fox jumps over the lazy dog.", "Permission is hereby granted,"
             " free of charge, to any person obtaining a copy", "<|endoftext|> is text here"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts[:2]))
    (tmp_path / "b.txt").write_text(texts[2])
    prefix = str(tmp_path / "out")
    summary = prepare([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")], "gpt2", prefix,
                      field="body", workers=2)
    tok = Gpt2()
    want = [tok.encode(t) + [50256] for t in texts]
    assert summary.documents == 3 and summary.tokens == sum(map(len, want))
    assert "3 documents" in summary.line() and "tokens/s" in summary.line()
    m = _megatron().IndexedDataset(prefix)
    assert [m[i].tolist() for i in range(len(m))] == want
    assert m.index.dtype is np.uint16  # Megatron's own choice for a vocabulary under 65500
    assert m.document_indices.tolist() == [0, 1, 2, 3]
    # The special token's spelling in a text is text: only the real end of document is 50256.
    assert want[2][:-1].count(50256) == 0
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's published ids
    info = inspect(prefix, "gpt2")
    assert info["documents"] == 3 and info["samples"][0]["text"].startswith("The quick")
    assert info["max_token"] == 50256
    # Recorded by prepare beside the .idx, for the files as written: what a scan finds.
    assert info["scan"] == "meta"
    assert corpus_scan.read_meta(prefix) == corpus_scan.scan(prefix)


def test_prepare_refuses_bad_inputs(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(PrepareError, match=r"x.jsonl:2: no text field 'text'"):
        prepare([str(tmp_path / "x.jsonl")], "gpt2", str(tmp_path / "o"))
    with pytest.raises(PrepareError, match="not .jsonl, .txt or .parquet"):
        (tmp_path / "x.csv").write_text("a")
        prepare([str(tmp_path / "x.csv")], "gpt2", str(tmp_path / "o"))
    with pytest.raises(PrepareError, match="neither 'gpt2' nor a tokenizer folder"):
        prepare([str(tmp_path / "x.jsonl")], "nope", str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o.bin") and not os.path.exists(tmp_path / "o.bin.tmp")


def test_parquet_and_hf_tokenizer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers

    pq.write_table(pa.table({"text": ["a b c", "b c a b"]}), tmp_path / "t.parquet")
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "</s>": 3, "[UNK]": 4},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    prefix = str(tmp_path / "p")
    s = prepare([str(tmp_path / "t.parquet")], str(tmp_path / "tokenizer.json"), prefix)
    assert s.documents == 2
    c = corpus.Corpus(prefix)
    assert [c[i].tolist() for i in range(2)] == [[0, 1, 2, 3], [1, 2, 0, 1, 3]]


# --- the header checks ------------------------------------------------------------------------

def _refusal(prefix: str, vocab: int = 50257) -> corpus.CorpusError:
    with pytest.raises(corpus.CorpusError) as err:
        corpus.check(prefix, vocab)
    return err.value


def test_header_refusals(tmp_path):
    prefix = str(tmp_path / "c")
    _megatron_corpus(prefix, np.int32)
    corpus.check(prefix, 50257)
    idx = (tmp_path / "c.idx").read_bytes()
    bin_ = (tmp_path / "c.bin").read_bytes()

    def write(idx_bytes: bytes = idx, bin_bytes: bytes = bin_) -> None:
        (tmp_path / "c.idx").write_bytes(idx_bytes)
        (tmp_path / "c.bin").write_bytes(bin_bytes)

    err = _refusal(str(tmp_path / "missing"))
    assert err.file.endswith("missing.idx") and err.reason == "no such file"
    write(b"NOTMEGAT\x00" + idx[9:])
    assert "wrong magic" in _refusal(prefix).reason
    write(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    assert "wrong version 2" in _refusal(prefix).reason
    write(idx + b"\x00" * 8)
    err = _refusal(prefix)
    assert err.file == prefix + ".idx" and "counts disagree with the file's size" in err.reason
    write(idx, bin_[:-4])
    err = _refusal(prefix)
    assert err.file == prefix + ".bin" and "counts disagree with the file's size" in err.reason
    write(idx, bin_[:-4] + struct.pack("<i", 60000))
    err = _refusal(prefix)
    assert err.file == prefix + ".bin"
    assert "token id 60000" in err.reason and "model.vocab(50257)" in err.reason
    write()
    assert corpus.check(prefix, 50257).tokens == len(bin_) // 4


def test_cli_prepare_and_inspect(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    (tmp_path / "a.txt").write_text("Hello world. " * 50)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "Second document."}) + "\n")
    prefix = str(tmp_path / "c")
    r = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "a.txt"),
                                 str(tmp_path / "b.jsonl"), "--out", prefix, "--workers", "2"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"{prefix}: 2 documents, ") and "tokens/s (gpt2" in r.output
    r = CliRunner().invoke(app, ["data", "inspect", prefix, "--tokenizer", "gpt2"])
    assert r.exit_code == 0, r.output
    assert "version 1, dtype uint16" in r.output and "2 documents" in r.output
    assert '"Hello world. Hello' in r.output and "largest token id 50256" in r.output
    r = CliRunner().invoke(app, ["data", "inspect", str(tmp_path / "nope")])
    assert r.exit_code != 0 and "nope.idx: no such file" in r.output
    r = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "a.md"), "--out", prefix])
    assert r.exit_code != 0 and "a.md: no such file" in r.output


def test_the_header_checks_hold_across_chunks(tmp_path, monkeypatch):
    """`read_header` reads the `.idx` `CHECK_CHUNK` sequences at a time: a fault in a later
    chunk, or across two, is found as in the first."""
    from tests.corpora import write_corpus

    monkeypatch.setattr(corpus, "CHECK_CHUNK", 4)
    prefix = tmp_path / "c"
    write_corpus(prefix, [[i % 7] * (i + 1) for i in range(10)])
    good = (tmp_path / "c.idx").read_bytes()
    h = corpus.read_header(str(prefix))
    assert (h.sequences, h.documents, h.tokens) == (10, 10, 55)
    assert corpus.tokens_from(h, 6) == 7 + 8 + 9 + 10 and corpus.boundary(h, 6) == 6

    def refused(offset: int, value: bytes) -> str:
        (tmp_path / "c.idx").write_bytes(good[:offset] + value + good[offset + len(value):])
        with pytest.raises(corpus.CorpusError) as err:
            corpus.read_header(str(prefix))
        return err.value.reason

    lengths, pointers, bounds = 34, 34 + 4 * 10, 34 + 12 * 10
    assert refused(lengths + 4 * 9, struct.pack("<i", -1)) == "a sequence length is negative"
    assert "the byte offset of sequence 7 is 1" in refused(pointers + 8 * 7, struct.pack("<q", 1))
    assert "without going back" in refused(bounds + 8 * 4, struct.pack("<q", 2))  # 2nd chunk


# --- tokenizers as the model expects them ----------------------------------------------------

def _docs(tmp_path, texts: list[str]) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


@pytest.mark.parametrize("template_bos,config,bos", [
    (True, {}, True),                           # Llama 3: the post-processor's template
    (False, {"add_bos_token": True}, True),     # Llama 2, Mistral: the config's key
    (True, {"add_bos_token": False}, False),    # the config's key wins over the template
    (False, {}, False),                         # Qwen: neither
])
def test_a_tokenizer_folder_adds_bos_as_transformers_does(tmp_path, template_bos, config, bos):
    """`prepare` reading a tokenizer folder writes each document as `transformers`' tokenizer
    of that folder encodes it (`add_special_tokens=True`), followed by EOS. `add_bos_token`
    is honoured as Llama's tokenizer classes do (they rewrite the post-processor from it);
    the generic class read here ignores the key, so then the BOS is checked apart."""
    from transformers import AutoTokenizer

    from tests.tokenizer_folders import make, vocab

    folder = make(tmp_path / "tok", template_bos=template_bos, config=config)
    texts = ["hello world", "what is two plus three", "the sky is blue <s> </s>"]
    prefix = str(tmp_path / "c")
    s = prepare([_docs(tmp_path, texts)], str(folder), prefix)
    c = corpus.Corpus(prefix)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    v = vocab()
    for i, text in enumerate(texts):
        keyed = "add_bos_token" in config
        want = ([v["<s>"]] if keyed and bos else []) + \
            hf(text, add_special_tokens=not keyed)["input_ids"] + [v["</s>"]]
        assert c[i].tolist() == want
        assert (c[i][0] == v["<s>"]) == bos
    # Text spelling a special token is that token, as in transformers (split_special_tokens
    # false), and the EOS still ends the document.
    assert c[2].tolist()[-3:] == [v["<s>"], v["</s>"], v["</s>"]]
    assert (s.specials["bos"] is not None) == bos
    assert s.specials["eos"] == {"token": "</s>", "id": v["</s>"]}
    assert ("BOS <s> (1) before each document" in s.line()) == bos


def test_tokenizer_refusals_name_the_key(tmp_path):
    from tests.tokenizer_folders import make

    for config, words in [({"eos_token": "<eot>"}, "eos_token '<eot>' is not a token"),
                          ({"add_bos_token": "yes"}, "add_bos_token must be true or false"),
                          ({"add_bos_token": True, "bos_token": "<bos>"},
                           "bos_token '<bos>' is not a token")]:
        folder = make(tmp_path / "t", template_bos=False, config=config)
        with pytest.raises(PrepareError, match=words):
            prepare([_docs(tmp_path, ["hello"])], str(folder), str(tmp_path / "o"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match="holds no tokenizer.json"):
        prepare([_docs(tmp_path, ["hello"])], str(tmp_path / "empty"), str(tmp_path / "o"))
    (tmp_path / "t" / "tokenizer_config.json").write_text("[1")
    with pytest.raises(PrepareError, match="tokenizer_config.json is not JSON"):
        prepare([_docs(tmp_path, ["hello"])], str(tmp_path / "t"), str(tmp_path / "o"))


def test_cli_inspect_shows_the_special_tokens(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    from tests.tokenizer_folders import make

    folder = make(tmp_path / "tok")
    prefix = str(tmp_path / "c")
    r = CliRunner().invoke(app, ["data", "prepare", _docs(tmp_path, ["hello world"]),
                                 "--out", prefix, "--tokenizer", str(folder),
                                 "--workers", "2"])
    assert r.exit_code == 0, r.output
    assert "BOS <s> (1) before each document, EOS </s> (2) after each" in r.output
    r = CliRunner().invoke(app, ["data", "inspect", prefix, "--tokenizer", str(folder)])
    assert r.exit_code == 0, r.output
    assert ("tokenizer: BOS <s> (1) before each document, EOS </s> (2) after each; chat"
            " template: yes") in r.output
    assert '"<s> hello world </s>"' in r.output
    r = CliRunner().invoke(app, ["data", "inspect", prefix, "--tokenizer", "gpt2", "--json"])
    specials = json.loads(r.output)["special_tokens"]
    assert specials["bos"] is None and specials["eos"] == {"token": "<|endoftext|>",
                                                           "id": 50256}
