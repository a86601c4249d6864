"""Hugging Face tokenizer folders made at test time (no downloads): a small word-level
vocabulary in `tokenizer.json` (the `tokenizers` library) and its `tokenizer_config.json`,
Llama-style (a post-processor template that puts `<s>` before the text) or Qwen-style (none),
with a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORDS = ["hello", "world", "how", "are", "you", "fine", "thanks", "what", "is", "two", "plus",
         "three", "five", "the", "sky", "blue", "tell", "me", "a", "joke", "no", "why", "yes"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
"""A chat template in the shape real ones have: a role marker, the content, an end-of-turn
token; the assistant's marker alone as the generation prompt."""


def vocab() -> dict[str, int]:
    return {t: i for i, t in enumerate(SPECIALS + WORDS)}


def make(folder: Path, *, template_bos: bool = True, config: dict[str, Any] | None = None,
         chat: bool = True) -> Path:
    """A tokenizer folder at `folder`: `tokenizer.json` (its post-processor puts `<s>` before
    the text when `template_bos`) and `tokenizer_config.json` (`config` added to the bos and
    eos tokens, the chat template when `chat`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    folder.mkdir(parents=True, exist_ok=True)
    v = vocab()
    tok = Tokenizer(models.WordLevel(v, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if template_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", v["<s>"])])
    tok.save(str(folder / "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                           "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
                           "model_max_length": 4096}
    if chat:
        cfg["chat_template"] = CHAT_TEMPLATE
    cfg.update(config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return folder


CONVERSATIONS = [
    [{"role": "user", "content": "hello how are you"},
     {"role": "assistant", "content": "fine thanks"}],
    [{"role": "system", "content": "tell me a joke"},
     {"role": "user", "content": "what is two plus three"},
     {"role": "assistant", "content": "five"},
     {"role": "user", "content": "why"},
     {"role": "assistant", "content": "no joke"}],
]


def write_chats(path, conversations=CONVERSATIONS) -> str:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return str(path)
