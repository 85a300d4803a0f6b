"""`hpctrain data build ... --tokenizer tok.json` with the tokenizer's encoding replaced by a fast stand-in (a
piece's UTF-8 bytes as its ids), so that a test can stream a gigabyte through everything else of a tokenizer
build (decompression, decoding, document pieces, token files) in seconds. The real tokenizer's memory for its
largest piece is measured on its own (tests/multiproc/data/test_data_build_bounded.py).

    python tests/workers/fast_tokenizer_build.py data build OUT INPUT --tokenizer tok.json
"""
from __future__ import annotations

import sys

import numpy as np

from hpctrain.cli.main import main
from hpctrain.data import tokenize as tokenized


class _Encoding:
    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids


class _ByteTokenizer:
    """What hpctrain.data.tokenize asks of a tokenizers.Tokenizer in a build: encode_batch(texts) -> objects with
    .ids"""

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[_Encoding]:
        return [_Encoding(np.frombuffer(t.encode("utf-8"), dtype=np.uint8)) for t in texts]


def _init_worker(tokenizer_json: str) -> None:
    tokenized._WORKER["tok"] = _ByteTokenizer()


tokenized._init_worker = _init_worker  # the builder looks it up when it starts encoding
main(sys.argv[1:], prog_name="hpctrain")
