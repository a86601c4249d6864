"""`trident data prepare` and `trident data inspect`: local commands (no server) that make and
describe a corpus (`service.files.corpus_prepare`, `docs/data.md`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail

data_app = typer.Typer(no_args_is_help=True,
                       help="Make and inspect tokenized corpora (no server).")


@data_app.command()
def prepare(inputs: Annotated[list[Path], typer.Argument(
                help=".jsonl (a text field per line), .txt (one document) or .parquet files.")],
            out: Annotated[str, typer.Option(help="The corpus's prefix: writes PREFIX.bin and"
                                             " PREFIX.idx.")],
            tokenizer: Annotated[str, typer.Option(
                help="gpt2 (GPT-2's BPE, offline), a Hugging Face tokenizer folder"
                     " (tokenizer.json + tokenizer_config.json) or a tokenizer.json.")]
            = "gpt2",
            field: Annotated[str, typer.Option(
                help="The text field of .jsonl lines and the column of .parquet files.")]
            = "text",
            workers: Annotated[int, typer.Option(
                min=0, max=256, help="Tokenizing processes; 0: one per CPU, at most 8.")] = 0,
            chat: Annotated[bool, typer.Option(
                "--chat", help="Conversations (.jsonl, {\"messages\": [...]}) for fine-tuning:"
                " rendered with the tokenizer folder's chat template, with a loss mask"
                " (PREFIX_loss_mask) where only the assistant's tokens train.")] = False,
            ) -> None:
    """Tokenize text into a corpus in Megatron's indexed dataset format (PREFIX.bin,
    PREFIX.idx): the tokenizer's BOS before each document where its config adds one, an
    end-of-document token (EOS) after each; prints a summary (documents, tokens, bytes,
    tokens per second, the special tokens used).

    With --chat, conversations become a fine-tuning corpus and its loss mask
    (PREFIX_loss_mask.bin/.idx, same documents), in one process.

    Example: trident data prepare books/*.jsonl --tokenizer gpt2 --out /corpora/books/books
    """
    from service.files.corpus_prepare import PrepareError, on_terminal
    from service.files.corpus_prepare import prepare as run

    n = workers or max(1, min(8, os.cpu_count() or 1))
    try:
        if chat:
            from service.files.chat_prepare import prepare_chat

            summary = prepare_chat([str(p) for p in inputs], tokenizer, out)
        elif on_terminal():
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            with Progress(SpinnerColumn(), TextColumn("{task.description}"),
                          TimeElapsedColumn(), transient=True) as bar:
                task = bar.add_task("tokenizing", total=None)
                summary = run([str(p) for p in inputs], tokenizer, out, field=field, workers=n,
                              progress=lambda d, t: bar.update(
                                  task, description=f"{d} documents, {t} tokens"))
        else:
            summary = run([str(p) for p in inputs], tokenizer, out, field=field, workers=n)
    except (PrepareError, OSError) as exc:
        fail(str(exc))
    typer.echo(summary.line())


@data_app.command()
def inspect(prefix: Annotated[str, typer.Argument(help="The corpus's prefix (no .bin/.idx).")],
            tokenizer: Annotated[str | None, typer.Option(
                help="Decode the samples with this tokenizer (gpt2, a tokenizer folder or a"
                     " tokenizer.json) and show its special tokens.")]
            = None,
            samples: Annotated[int, typer.Option(min=0, max=100)] = 3,
            index: Annotated[bool, typer.Option(
                "--index", help="Record the scan of its token ids under the server's data"
                " directory (TRIDENT_DATA_DIR), where the controller finds it: a corpus"
                " without PREFIX.meta.json (prepared by Megatron's own tool) is then never"
                " scanned before a job.")] = False,
            as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Print a corpus's header (magic, version, dtype), its counts (sequences, documents,
    tokens), its largest token id (from PREFIX.meta.json or the data directory's record when
    one describes the files, else scanned), and its first documents (decoded with --tokenizer,
    whose special tokens it shows: BOS, EOS, whether a BOS is added and why, a chat template).

    Example: trident data inspect /corpora/books/books --tokenizer gpt2 --index
    """
    from service.files.corpus import CorpusError
    from service.files.corpus_prepare import PrepareError
    from service.files.corpus_prepare import inspect as run
    from service.settings import Settings

    try:
        info = run(prefix, tokenizer, samples, data_dir=Settings().data_dir, index=index)
    except (CorpusError, PrepareError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"{info['prefix']}: Megatron indexed dataset, magic {info['magic']!r}, version"
               f" {info['version']}, dtype {info['dtype']}")
    typer.echo(f"  {info['documents']} documents, {info['sequences']} sequences,"
               f" {info['tokens']} tokens (mean {info['mean_sequence']:.1f} per sequence),"
               f" largest token id {info['max_token']} ({SCAN_SAID[info['scan']]})")
    typer.echo(f"  .idx {info['idx_bytes']} bytes, .bin {info['bin_bytes']} bytes")
    if (specials := info["special_tokens"]) is not None:
        from service.files.corpus_prepare import special_line

        typer.echo(f"  tokenizer: {special_line(specials)}; chat template:"
                   f" {'yes' if specials['chat_template'] else 'no'}")
    if info["loss_mask"] is not None:
        typer.echo(f"  loss mask {info['loss_mask']}: {info['trained_tokens']} of"
                   f" {info['tokens']} tokens train")
    for s in info["samples"]:
        shown = json.dumps(s["text"]) if s["text"] is not None else s["ids"]
        typer.echo(f"  [{s['sequence']}] {s['tokens']} tokens: {shown}")


SCAN_SAID = {"meta": "from PREFIX.meta.json", "data_dir": "from the data directory's record",
             "scanned": "scanned now", "recorded": "scanned now, recorded in the data directory"}


def register(app: typer.Typer) -> None:
    """Add `trident data ...` to the `trident` app."""
    app.add_typer(data_app, name="data")
