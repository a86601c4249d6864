"""Conversations into a fine-tuning corpus (`trident data prepare --chat`): the tokens, and a
loss mask beside them that says which tokens train (the assistant's).

Input: `.jsonl`, one conversation a line, `{"messages": [{"role": ..., "content": ...}, ...]}`
with at least one `assistant` message. Each conversation is rendered with the tokenizer
folder's chat template (`chat_template` in `tokenizer_config.json`, through `transformers`'
`apply_chat_template`, which runs it in jinja2) and tokenized as `apply_chat_template` does
(`add_special_tokens=False`: a template writes its own BOS); the tokenizer's EOS follows unless
the rendering already ends with it. An assistant turn's tokens are those the template writes
between the conversation up to that turn rendered with `add_generation_prompt=True` (the
prompt: `<|assistant|>` and the like, which does not train) and the conversation up to and with
that turn (its content and the end of the turn, which train). A template whose renderings are
not prefixes of one another cannot say which tokens those are, and is refused.

Output: `PREFIX.bin/.idx` (the tokens) and `PREFIX_loss_mask.bin/.idx` (uint8, 1 where the
token trains), both Megatron indexed datasets with the same sequences and document boundaries,
written with Megatron's `IndexedDatasetBuilder` under temporary names, renamed when complete;
then the tokens' `PREFIX.meta.json` (`service.files.corpus_scan`), as for text.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from service.files import corpus, corpus_scan
from service.files.corpus_prepare import Summary, megatron_builder
from service.files.tokenizer import HfTokenizer, PrepareError, load_tokenizer

MASK_SUFFIX = "_loss_mask"
ROLES = ("system", "user", "assistant", "tool")


def mask_prefix(prefix: str) -> str:
    """The loss mask's corpus beside the tokens' corpus `prefix`."""
    return prefix + MASK_SUFFIX


def conversations(path: str) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """(line number, messages) of each conversation of `path`, checked."""
    if not os.path.isfile(path):
        raise PrepareError(f"{path}: no such file")
    if not path.endswith(".jsonl"):
        raise PrepareError(f"{path}: --chat reads .jsonl conversations")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise PrepareError(f"{where}: not JSON ({exc})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                raise PrepareError(f"{where}: no 'messages' list")
            for k, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                    raise PrepareError(f"{where}: messages[{k}] has no text 'content'")
                if m.get("role") not in ROLES:
                    raise PrepareError(f"{where}: messages[{k}].role {m.get('role')!r} is not"
                                       f" one of {', '.join(ROLES)}")
            if not any(m["role"] == "assistant" for m in messages):
                raise PrepareError(f"{where}: no assistant message (nothing would train)")
            yield number, [{"role": m["role"], "content": m["content"]} for m in messages]


class ChatTemplate:
    """A tokenizer folder's chat template, rendered by `transformers`."""

    def __init__(self, folder: str) -> None:
        tok = load_tokenizer(folder)
        if not isinstance(tok, HfTokenizer) or not os.path.isdir(folder):
            raise PrepareError(f"--tokenizer {folder}: --chat needs a tokenizer folder"
                               f" (tokenizer.json and tokenizer_config.json)")
        if not isinstance(tok.config.get("chat_template"), str):
            raise PrepareError(f"--tokenizer {folder}: tokenizer_config.json has no"
                               f" chat_template")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise PrepareError("--chat renders chat templates with transformers, which is not"
                               " installed (pip install transformers)") from None
        self.tok = tok
        self.hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)

    def render(self, messages: list[dict[str, str]], prompt: bool = False) -> str:
        return str(self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=prompt))

    def encode(self, where: str, messages: list[dict[str, str]]
               ) -> tuple[list[int], list[int]]:
        """The tokens of a conversation and its loss mask (1: an assistant token)."""
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, upto = self.render(messages[:i], prompt=True), self.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise PrepareError(f"{where}: the chat template does not render the turns"
                                   f" before message {i} as the start of the conversation,"
                                   f" so its assistant tokens cannot be told apart")
            spans.append((len(before), len(upto)))
        enc = self.tok._tok.encode(text, add_special_tokens=False)
        ids = [int(t) for t in enc.ids]
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
        if not ids or ids[-1] != self.tok.eod:
            ids.append(self.tok.eod)
            mask.append(0)
        return ids, mask


def prepare_chat(inputs: list[str], tokenizer: str, out: str,
                 progress: Callable[[int, int], None] | None = None) -> Summary:
    """Conversations of `inputs` into the corpus `out` and its loss mask `out_loss_mask`."""
    if not inputs:
        raise PrepareError("no input files")
    for path in inputs:
        if not os.path.isfile(path):
            raise PrepareError(f"{path}: no such file")
    chat = ChatTemplate(tokenizer)
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise PrepareError(f"--out {out}: folder {folder} does not exist")
    targets = [corpus.bin_path(out), corpus.idx_path(out), corpus.bin_path(mask_prefix(out)),
               corpus.idx_path(mask_prefix(out))]
    tmps = [p + ".tmp" for p in targets]
    builder_class = megatron_builder()
    t0 = time.perf_counter()
    docs = tokens = nbytes = trained = 0
    top, top_at = -1, -1  # the largest token id, for PREFIX.meta.json
    try:
        tok_builder = builder_class(tmps[0], dtype=corpus.token_dtype(chat.tok.vocab))
        mask_builder = builder_class(tmps[2], dtype=np.uint8)
        for path in inputs:
            for number, messages in conversations(path):
                ids, mask = chat.encode(f"{path}:{number}", messages)
                if max(ids) > top:
                    top, top_at = max(ids), tokens + ids.index(max(ids))
                tok_builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
                mask_builder.add_document(np.asarray(mask, dtype=np.int64), [len(mask)])
                docs += 1
                tokens += len(ids)
                trained += sum(mask)
                nbytes += sum(len(m["content"].encode("utf-8")) for m in messages)
                if progress is not None:
                    progress(docs, tokens)
        tok_builder.finalize(tmps[1])
        mask_builder.finalize(tmps[3])
        for tmp, target in zip(tmps, targets, strict=True):
            os.replace(tmp, target)
        corpus_scan.write_meta(out, corpus_scan.Scan(
            fingerprint=corpus_scan.scan_print(out), tokens=tokens, max_token=top,
            max_at=top_at, min_token=0))
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
    specials: dict[str, Any] = {**chat.tok.specials(), "trained_tokens": trained}
    return Summary(documents=docs, tokens=tokens, bytes=nbytes,
                   seconds=time.perf_counter() - t0, prefix=out, tokenizer=chat.tok.name,
                   vocab=chat.tok.vocab, specials=specials)
