"""`hpctrain data build`: token datasets, byte level (hpctrain.data.build) or with a tokenizer (hpctrain.data.tokenize).

    hpctrain data build data/corpus.bin                                  # the bundled corpus, byte level
    hpctrain data build data/web.bin corpus/ more.jsonl.gz --tokenizer tokenizer.json --val-fraction 0.01
"""
from __future__ import annotations

from pathlib import Path

import click

from hpctrain.cli.common import user_errors


@click.group(name="data")
def data_group() -> None:
    """Token datasets."""


@data_group.command(name="build")
@click.argument("out", type=click.Path(dir_okay=False))
@click.argument("inputs", nargs=-1, type=click.Path(exists=True))
@click.option("--tokenizer", type=click.Path(dir_okay=False), default=None,
              help="a tokenizers tokenizer.json (BPE...): encode with it; without it, byte-level tokens")
@click.option("--field", default="text", show_default=True, help="the text field of JSON lines inputs")
@click.option("--val-fraction", type=float, default=0.0, show_default=True,
              help="share of documents written to the validation split <stem>.val<suffix> (with --tokenizer)")
@click.option("--seed", type=int, default=0, show_default=True, help="which documents the split takes")
@click.option("--workers", type=int, default=0, help="encoding processes (default: min(cores, 8))")
@click.option("--eos", default=None, help="the EOS token between documents (default: <|endoftext|>, </s>, ...)")
@click.option("--max-line-mib", type=int, default=16, show_default=True,
              help="longest JSON line read (with --tokenizer); a longer one is an error naming it")
@user_errors
def data_build(out: str, inputs: tuple[str, ...], tokenizer: str | None, field: str, val_fraction: float,
               seed: int, workers: int, eos: str | None, max_line_mib: int) -> None:
    """Tokenize INPUTS (text files, JSON lines, .gz/.bz2/.xz/.zst; directories are walked) into OUT (.bin, .npy,
    .h5). Without --tokenizer: byte-level tokens, and with no INPUTS the bundled corpus (this project's own
    source and docs). Memory stays bounded whatever the size of a file: documents past 1 Mi characters are encoded
    in pieces (one EOS at the end)."""
    if tokenizer is None:
        from hpctrain.data import build as databuild
        extra = [name for name, value, default in (("--field", field, "text"), ("--val-fraction", val_fraction, 0.0),
                                                   ("--eos", eos, None), ("--max-line-mib", max_line_mib, 16))
                 if value != default]
        if extra:
            raise ValueError(f"{', '.join(extra)} need --tokenizer (byte-level builds take whole files)")
        stats = databuild.build_dataset([Path(i) for i in inputs] or databuild.project_corpus_inputs(), Path(out))
        click.echo(f"{out}: {stats['tokens']} tokens from {stats['files']} files ({stats['skipped']} skipped)")
        return
    from hpctrain.data import tokenize as tokenized
    if not inputs:
        raise ValueError("--tokenizer needs INPUTS: the files or directories to encode")
    if workers < 0:
        raise ValueError(f"--workers {workers} must be >= 0 (0: min(cores, 8))")
    s = tokenized.build_tokenized([Path(i) for i in inputs], Path(out), Path(tokenizer), field=field,
                                  val_fraction=val_fraction, seed=seed, workers=workers, eos=eos,
                                  max_line_mib=max_line_mib)
    val = f"; validation {s['val_path']}: {s['val_documents']} documents, {s['val_tokens']} tokens" \
        if s["val_path"] else ""
    click.echo(f"{out}: {s['documents']} documents, {s['tokens']} tokens ({s['dtype']}, vocab {s['vocab_size']}, "
               f"eos {s['eos_id']}) from {s['files']} files{val}")
