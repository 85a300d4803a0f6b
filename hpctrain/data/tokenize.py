"""Token datasets made with a real tokenizer: `hpctrain data build OUT INPUTS... --tokenizer tokenizer.json`.

    stats = build_tokenized([Path("corpus/")], Path("data/web.bin"), Path("tokenizer.json"), val_fraction=0.01)

Inputs are text files (each file one document), JSON lines (`*.jsonl`, `*.json`: one document per line, its text
under `field`), either of them compressed (.gz, .bz2, .xz; .zst when the zstandard package is there), and
directories of those. Each document is encoded by the tokenizer (the `tokenizers` library's tokenizer.json,
special tokens neither added nor read from the text) and followed by the tokenizer's EOS id. Files are encoded
by `workers` processes in parallel and written in input order, so the output is the same bytes for any number
of workers. A document goes to the validation split ("<stem>.val<suffix>" beside OUT) when a hash of (seed, its
index) falls below val_fraction: the same documents whatever the workers or formats. Ids are uint16 when the
vocabulary fits (<= 65536), else uint32. The record (sidecar JSON or HDF5 attributes) holds the tokenizer's
sha256, vocab size, EOS id, the document count and the range of ids written (tied to the file by its identity:
databuild.write_token_file), and a copy of tokenizer.json goes beside OUT
(tokenfiles.tokenizer_file), so a run records and checks which tokenizer made its data. Everything is written
under temporary names and renamed.

Memory is bounded whatever the input. Files (and compressed streams) are read in pieces, never whole. A document
longer than MAX_PIECE_CHARS (1 Mi) characters is encoded in pieces of at most that many, cut after the last
newline in the second half of the piece, else before its last space or tab, else anywhere; one call of the
tokenizer takes at most that many characters too. The pieces' tokens follow each other with no EOS between them,
and the document still counts once, goes to one split, and ends with one EOS. (A tokenizer can encode the text
around a cut a little differently than it would have unsplit; documents up to the cap are encoded whole, as
before.) A JSON line is read up to `max_line_mib` MiB: a longer one is an error naming the file and line
(skipping it would drop data silently; the bound can be raised). Tokens go to temporary files as they come: a
worker writes each file's tokens and document lengths to part files beside OUT, which the main process copies
into the splits in input order (at most two per worker wait at any time).

Errors name the file (and the line of a JSON line): text that is not UTF-8 (with its byte offset), a JSON line
that is not JSON, is nested deeper than untrusted.MAX_DEPTH, holds a lone surrogate or lacks the string field,
and a damaged compressed stream.
"""
from __future__ import annotations

import bz2
import codecs
import gzip
import hashlib
import io
import lzma
import os
import sys
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np

from hpctrain.data.build import OUT_SUFFIXES, TEXT_SUFFIXES, write_token_file
from hpctrain.data.tokenfiles import tokenizer_file, val_file
from hpctrain.fsutil import write_atomic
from hpctrain.untrusted import parse_json

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".zst": None}
_MAX_TOKENIZER_BYTES = 64 << 20
# The tokenizers library holds a few hundred bytes per character of a string while it encodes it (a property of
# the library, not of a machine: about +350 MB for a 1 Mi-character line of English): pieces, and batches, of at
# most 1 Mi characters keep an encoding process near 400 MB however long a document or a line is.
MAX_PIECE_CHARS = 1 << 20
BATCH_PIECES = 256
MAX_LINE_MIB = 16  # default bound of one JSON line (--max-line-mib)
READ_BYTES = 1 << 20  # text is read and decoded in pieces of this many bytes
_COPY_TOKENS = 1 << 20  # a part file's document is copied in pieces of at most this many tokens


_ZSTD_INPUT = 1 << 10  # compressed bytes per step: zstd expands at most ~32,000 times, so a step gives <= ~32 MiB


class _ZstdReader(io.RawIOBase):
    """A .zst file's bytes, frame after frame, in bounded steps, and an EOFError when the file ends inside a frame:
    zstandard's own stream reader ends there silently, which would drop the rest of a cut file unnoticed."""

    def __init__(self, path: Path) -> None:
        import zstandard
        self._dctx = zstandard.ZstdDecompressor()
        self._src = open(path, "rb")
        self._frame = None  # the decompressor of the frame being read; None between frames
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._src.close()
        super().close()

    def readinto(self, buf) -> int:
        while self._pos == len(self._out):
            data = self._src.read(_ZSTD_INPUT)
            if not data:
                if self._frame is not None:
                    raise EOFError("the zstd stream ends inside a frame")
                return 0
            out = []
            while data:
                if self._frame is None:
                    self._frame = self._dctx.decompressobj()
                out.append(self._frame.decompress(data))
                data = b""
                if self._frame.eof:  # the rest starts the next frame
                    data, self._frame = self._frame.unused_data, None
            self._out, self._pos = b"".join(out), 0
        n = min(len(buf), len(self._out) - self._pos)
        buf[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n


def _zstd_open(path: Path):
    try:
        import zstandard  # noqa: F401
    except ImportError:
        raise ValueError(f"{str(path)!r} is zstd-compressed: pip install zstandard to read it") from None
    return io.BufferedReader(_ZstdReader(path))  # readline, bounded like every other stream's


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged file or compressed stream raises (zlib and zstd errors are no OSError)."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error, lzma.LZMAError)
    try:
        import zstandard
        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def _kind(path: Path) -> tuple[str, str] | None:
    """(compression suffix or "", "jsonl" | "text") of an input file, None when it is neither."""
    comp = path.suffix if path.suffix in COMPRESSED else ""
    inner = Path(path.name[:-len(comp)] if comp else path.name).suffix
    if inner in JSONL_SUFFIXES:
        return comp, "jsonl"
    if inner in TEXT_SUFFIXES or inner == "":
        return comp, "text"
    return None


def input_files(inputs: list[Path]) -> list[Path]:
    """The files to encode, in a fixed order: named files as given, directories walked (sorted), hidden ones
    skipped; a name given twice counts once."""
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files += sorted(p for p in item.rglob("*") if p.is_file() and _kind(p) is not None
                            and not any(part.startswith(".") for part in p.relative_to(item).parts))
        elif item.is_file():
            files.append(item)
        else:
            raise ValueError(f"dataset input {str(item)!r} does not exist")
    unique = list(dict.fromkeys(f.resolve() for f in files))
    if not unique:
        raise ValueError(f"no input files (text, JSON lines, compressed) found in {[str(p) for p in inputs]}")
    return unique


def _text_chunks(f: BinaryIO, path: Path) -> Iterator[str]:
    """A binary stream's UTF-8 text in pieces, line ends translated as text mode does ("\r\n" and "\r" become
    "\n"), as open(path, "rt") read it whole before."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    text = io.IncrementalNewlineDecoder(utf8, translate=True)
    done = 0  # bytes decoded before this piece
    final = False
    while not final:
        raw = f.read(READ_BYTES)
        final = not raw
        pending = len(utf8.getstate()[0])  # bytes of a character cut by the previous piece
        try:
            chunk = text.decode(raw, final=final)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {done - pending + e.start})") from None
        done += len(raw)
        if chunk:
            yield chunk


def _cut(text: str, lo: int, hi: int) -> int:
    """Where a piece text[lo:hi] (hi - lo = the cap) ends: after the last newline in its second half, else before
    its last space or tab there (BPE pre-tokenizers put the space in front of the next word), else at hi."""
    mid = lo + (hi - lo) // 2
    newline = text.rfind("\n", mid, hi)
    if newline >= 0:
        return newline + 1
    space = max(text.rfind(" ", mid, hi), text.rfind("\t", mid, hi))
    return space if space > lo else hi


def split_document(chunks: Iterable[str], cap: int) -> Iterator[tuple[str, bool]]:
    """(piece, is_last) for one document given as consecutive chunks of text: pieces of at most `cap` characters
    (see _cut), the document whole when it fits. Nothing for an empty document."""
    buf = ""
    for chunk in chunks:
        buf = buf + chunk if buf else chunk
        pos = 0
        while len(buf) - pos > cap:
            cut = _cut(buf, pos, pos + cap)
            yield buf[pos:cut], False
            pos = cut
        buf = buf[pos:]
    if buf:
        yield buf, True


def _json_lines(f: BinaryIO, path: Path, limit: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a JSON lines stream, blank lines left out; a line longer than `limit` bytes is an
    error, found after reading limit + 1 of its bytes."""
    number = 0
    while line := f.readline(limit + 1):
        number += 1
        if len(line) > limit and not line.endswith(b"\n"):
            raise ValueError(f"{path}:{number}: a JSON line longer than {limit >> 20} MiB "
                             f"(--max-line-mib raises the bound)")
        if line.strip():
            yield number, line


def document_pieces(path: Path, field: str = "text", max_line_mib: int = MAX_LINE_MIB,
                    piece_chars: int = MAX_PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """(piece, is_last) of every document of one input file (the whole text, or each JSON line's `field`), pieces
    of at most `piece_chars` characters (split_document); empty documents are left out. Errors name the file."""
    comp, kind = _kind(path) or ("", "text")
    opener = _zstd_open if comp == ".zst" else lambda p: (COMPRESSED.get(comp) or open)(p, "rb")
    try:
        with opener(path) as f:
            if kind == "text":
                yield from split_document(_text_chunks(f, path), piece_chars)
                return
            for number, line in _json_lines(f, path, max_line_mib << 20):
                obj = parse_json(line, f"{path}:{number}")  # not JSON, too deep, a lone surrogate: Untrusted
                text = obj.get(field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{number}: no string field {field!r} (--field names it)")
                del obj, line  # the text alone stays while it is encoded
                yield from split_document([text], piece_chars)
    except _read_errors() as e:
        raise ValueError(f"{path}: cannot be read: {e}") from None


def load_tokenizer(path: Path):
    """The `tokenizers` Tokenizer of a tokenizer.json, its bytes' sha256, and those bytes (read once: the workers,
    the record and the copy beside the data all take these)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the tokenizers package: pip install 'hpctrain[hf]'") from None
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokenizer {str(path)!r} does not exist")
    if path.stat().st_size > _MAX_TOKENIZER_BYTES:
        raise ValueError(f"--tokenizer {str(path)!r} is {path.stat().st_size} bytes: too large for a tokenizer.json")
    raw = path.read_bytes()
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the Rust library raises its own exception type
        raise ValueError(f"--tokenizer {str(path)!r} is not a tokenizers tokenizer.json: {e}") from None
    return tok, hashlib.sha256(raw).hexdigest(), raw


def eos_id(tok, eos: str | None, where: str) -> int:
    names = [eos] if eos else list(EOS_CANDIDATES)
    for name in names:
        found = tok.token_to_id(name)
        if found is not None:
            return int(found)
    if eos:
        raise ValueError(f"--eos {eos!r} is not a token of {where}")
    raise ValueError(f"{where} has none of the EOS tokens {', '.join(EOS_CANDIDATES)}: name its EOS with --eos")


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tokenizer_json)
    # text that spells a special token ("<|endoftext|>" in a document about tokenizers) stays text: only the
    # builder puts EOS ids between documents
    tok.encode_special_tokens = True
    _WORKER["tok"] = tok


def _encode_batch(tok, batch: list[tuple[str, bool]], dtype: np.dtype) -> Iterator[tuple[bytes, int, bool]]:
    for e, (_, last) in zip(tok.encode_batch([text for text, _ in batch], add_special_tokens=False), batch):
        yield np.asarray(e.ids, dtype=dtype).tobytes(), len(e.ids), last


def _encoded(pieces: Iterable[tuple[str, bool]], tok, dtype: np.dtype, batch_chars: int
             ) -> Iterator[tuple[bytes, int, bool]]:
    """(token bytes in `dtype`, token count, ends its document) for each piece, encoded in batches of at most
    BATCH_PIECES pieces and `batch_chars` characters (one longer piece alone)."""
    batch: list[tuple[str, bool]] = []
    chars = 0
    for text, last in pieces:
        if batch and (len(batch) == BATCH_PIECES or chars + len(text) > batch_chars):
            yield from _encode_batch(tok, batch, dtype)
            batch, chars = [], 0
        batch.append((text, last))
        chars += len(text)
    if batch:
        yield from _encode_batch(tok, batch, dtype)


def _encode_file(args: tuple[str, str, int, int, str, str]) -> None:
    """One input file encoded into part files, in a worker process: `<part>.ids` (its tokens, no EOS) and
    `<part>.lens` (each document's token count, int64), read back by _replay."""
    path, field, max_line_mib, piece_chars, part, dtype = args
    lens: list[int] = []
    run = 0
    with open(f"{part}.ids", "wb") as ids, open(f"{part}.lens", "wb") as ends:
        for data, n, last in _encoded(document_pieces(Path(path), field, max_line_mib, piece_chars),
                                      _WORKER["tok"], np.dtype(dtype), piece_chars):
            ids.write(data)
            run += n
            if last:
                lens.append(run)
                run = 0
                if len(lens) == 1 << 16:
                    ends.write(np.asarray(lens, dtype="<i8").tobytes())
                    lens = []
        ends.write(np.asarray(lens, dtype="<i8").tobytes())


def _replay(part: str, dtype: np.dtype) -> Iterator[tuple[bytes, int, bool]]:
    """A worker's part files as _encoded yielded them (documents in pieces of at most _COPY_TOKENS tokens)."""
    with open(f"{part}.ids", "rb") as ids, open(f"{part}.lens", "rb") as ends:
        while block := ends.read(8 << 16):
            for n in np.frombuffer(block, dtype="<i8").tolist():
                while True:
                    k = min(n, _COPY_TOKENS)
                    yield ids.read(k * dtype.itemsize), k, k == n
                    n -= k
                    if n == 0:
                        break


class _Splits:
    """The train and validation token streams being written: each document whole to the split its index picks,
    followed by EOS."""

    def __init__(self, sinks: dict[str, BinaryIO], eos_id: int, dtype: np.dtype, seed: int,
                 val_fraction: float) -> None:
        self.sinks, self.dtype, self.seed, self.val_fraction = sinks, dtype, seed, val_fraction
        self.eos_id, self.eos = eos_id, np.asarray([eos_id], dtype=dtype).tobytes()
        self.counts = {split: [0, 0] for split in sinks}  # documents, tokens
        self.max_id = {split: -1 for split in sinks}  # the largest id written: data build's record of the ids
        self.index = 0  # documents written so far, over all files

    def take(self, pieces: Iterable[tuple[bytes, int, bool]]) -> tuple[int, int]:
        """Writes one file's encoded pieces; returns its (documents, tokens)."""
        docs = tokens = 0
        split = None
        for data, n, last in pieces:
            if split is None:  # a document's first piece
                split = "val" if in_val(self.seed, self.index, self.val_fraction) else "train"
            self.sinks[split].write(data)
            tokens += n
            self.counts[split][1] += n
            if n:  # a pass over tokens already in memory: cheap beside encoding them
                self.max_id[split] = max(self.max_id[split], int(np.frombuffer(data, dtype=self.dtype).max()))
            if last:
                self.sinks[split].write(self.eos)
                self.max_id[split] = max(self.max_id[split], self.eos_id)
                self.counts[split][0] += 1
                self.counts[split][1] += 1
                self.index += 1
                docs += 1
                tokens += 1
                split = None
        assert split is None, "a file's last piece ends its document"
        return docs, tokens


def in_val(seed: int, index: int, fraction: float) -> bool:
    """Whether document `index` goes to the validation split: a hash of (seed, index) below the fraction."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64 < fraction


class Progress:
    """Documents, tokens and input MB/s: one redrawn line on a terminal, else a plain line every `every_s`."""

    def __init__(self, total_files: int, stream=None, every_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total, self.every_s, self.t0, self.last = total_files, every_s, time.monotonic(), 0.0
        self.files = self.docs = self.tokens = self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int, final: bool = False) -> None:
        self.files += 0 if final else 1
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        now = time.monotonic()
        if not (final or now - self.last >= (0.2 if self.tty else self.every_s)):
            return
        self.last = now
        rate = self.bytes / 1e6 / max(now - self.t0, 1e-9)
        line = (f"files {self.files}/{self.total}  documents {self.docs}  tokens {self.tokens}  "
                f"{rate:.1f} MB/s")
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()


def _dtype(vocab: int) -> np.dtype:
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def build_tokenized(inputs: list[Path], out: Path, tokenizer: Path, field: str = "text", val_fraction: float = 0.0,
                    seed: int = 0, workers: int = 0, eos: str | None = None, max_line_mib: int = MAX_LINE_MIB,
                    piece_chars: int = MAX_PIECE_CHARS, progress: Callable[[int, int, int], None] | None = None
                    ) -> dict[str, Any]:
    """Encodes the inputs into `out` (and its validation split); see the module docstring (`piece_chars`: the
    longest string the tokenizer is given, MAX_PIECE_CHARS unless a caller knows better). Returns
    {"path", "val_path", "documents", "val_documents", "tokens", "val_tokens", "files", "dtype", "vocab_size",
    "eos_id", "tokenizer_sha256", "bytes"}."""
    out = Path(out)
    if out.suffix not in OUT_SUFFIXES:
        raise ValueError(f"dataset output {str(out)!r}: suffix {out.suffix!r} is not one of {', '.join(OUT_SUFFIXES)}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if type(max_line_mib) is not int or max_line_mib < 1:
        raise ValueError(f"--max-line-mib {max_line_mib!r} must be an integer >= 1")
    if type(piece_chars) is not int or piece_chars < 2:
        raise ValueError(f"piece_chars {piece_chars!r} must be an integer >= 2")
    tok, sha, tok_raw = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_token = eos_id(tok, eos, f"--tokenizer {str(tokenizer)!r}")
    files = input_files(inputs)
    dtype = _dtype(vocab)
    workers = workers or min(os.cpu_count() or 1, 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    raws = {split: out.with_name(f".{out.name}.{split}.{os.getpid()}.raw") for split in ("train", "val")}
    parts = [str(out.with_name(f".{out.name}.{os.getpid()}.part{i}")) for i in range(len(files))]
    show = Progress(len(files)) if progress is None else None
    try:
        with open(raws["train"], "wb") as train_f, open(raws["val"], "wb") as val_f:
            splits = _Splits({"train": train_f, "val": val_f}, eos_token, dtype, seed, val_fraction)
            if workers > 1 and len(files) > 1:
                _encode_in_pool([(str(f), field, max_line_mib, piece_chars, part, dtype.str)
                                 for f, part in zip(files, parts)], min(workers, len(files)),
                                tok_raw.decode("utf-8"), splits, progress or show.update)
            else:
                _init_worker(tok_raw.decode("utf-8"))
                for path in files:
                    docs, ntok = splits.take(_encoded(document_pieces(path, field, max_line_mib, piece_chars),
                                                      _WORKER["tok"], dtype, piece_chars))
                    (progress or show.update)(docs, ntok, path.stat().st_size)
        if show is not None:
            show.update(0, 0, 0, final=True)
        counts, index = splits.counts, splits.index
        if counts["train"][0] == 0:
            raise ValueError(f"no document went to the training split of {str(out)!r} ({index} documents read)")
        if val_fraction > 0 and counts["val"][0] == 0:
            raise ValueError(f"--val-fraction {val_fraction}: none of the {index} documents fell into the "
                             f"validation split; raise it or give more documents")
        base = {"dtype": dtype.name, "byteorder": "little", "vocab_size": vocab,
                "tokenizer": _model_type(tok_raw, tokenizer), "tokenizer_sha256": sha, "eos_id": eos_token}
        size = _finish(raws["train"], out, base | {"num_tokens": counts["train"][1], "num_docs": counts["train"][0],
                                                    "split": "train", "min_id": 0, "max_id": splits.max_id["train"]})
        val_path = None
        if val_fraction > 0:
            val_path = Path(val_file(str(out)))
            size += _finish(raws["val"], val_path, base | {"num_tokens": counts["val"][1],
                                                           "num_docs": counts["val"][0], "split": "val",
                                                           "min_id": 0, "max_id": splits.max_id["val"]})
        write_atomic(tokenizer_file(out), tok_raw)  # the bytes hashed above, whatever the file holds by now
    finally:
        for path in [*raws.values(), *(f"{p}.{end}" for p in parts for end in ("ids", "lens"))]:
            Path(path).unlink(missing_ok=True)
    return {"path": str(out), "val_path": str(val_path) if val_path else None, "files": len(files),
            "documents": counts["train"][0], "val_documents": counts["val"][0], "tokens": counts["train"][1],
            "val_tokens": counts["val"][1], "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos_token,
            "tokenizer_sha256": sha, "bytes": size}


def _encode_in_pool(jobs: list[tuple[str, str, int, int, str, str]], processes: int, tokenizer_json: str,
                    splits: _Splits, progress: Callable[[int, int, int], None]) -> None:
    """_encode_file(job) for every job by `processes` workers, the part files copied into `splits` in input order.
    At most two files per worker are encoded or waiting at a time: the part files on disk stay bounded too."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")  # no fork: the tokenizers library's threads must not cross it
    pool = ctx.Pool(processes, initializer=_init_worker, initargs=(tokenizer_json,))
    try:
        pending: deque = deque()
        todo = iter(jobs)
        for job in todo:
            pending.append((job, pool.apply_async(_encode_file, (job,))))
            if len(pending) == 2 * processes:
                break
        while pending:
            job, result = pending.popleft()
            result.get()  # a worker's error (a ValueError naming the file) is raised here
            for more in todo:  # one more file in flight
                pending.append((more, pool.apply_async(_encode_file, (more,))))
                break
            path, part, dtype = job[0], job[4], np.dtype(job[5])
            docs, ntok = splits.take(_replay(part, dtype))
            for end in ("ids", "lens"):
                Path(f"{part}.{end}").unlink()
            progress(docs, ntok, Path(path).stat().st_size)
    finally:
        pool.terminate()  # joins the workers too: none writes a part file after this


def _finish(raw: Path, out: Path, record: dict[str, Any]) -> int:
    """The raw tokens as `out` with the record (databuild.write_token_file; HDF5 attributes: all but the dtype)."""
    return write_token_file(raw, out, record, attrs=tuple(k for k in record if k not in ("dtype", "byteorder")))


def _model_type(raw: bytes, tokenizer: Path) -> str:
    """"bpe", "unigram", "wordpiece"...: the model type tokenizer.json names (lower case), "unknown" otherwise."""
    try:
        kind = parse_json(raw, f"--tokenizer {str(tokenizer)!r}").get("model", {}).get("type")
    except (ValueError, AttributeError):
        kind = None
    return kind.lower() if isinstance(kind, str) else "unknown"
