"""hpctrain.untrusted.hdf5_dataset: an HDF5 dataset is read only when all of its bytes lie in its own file (pure
tier, no torch), and the training data's HDF5 token files go through it.

    pytest tests/pure/test_untrusted_hdf5.py
"""
from __future__ import annotations

import pickle

import h5py
import numpy as np
import pytest
from faults import record

from hpctrain.data.tokenfiles import HDF5Source
from hpctrain.untrusted import HDF5_BUILTIN_FILTERS, ForeignData, hdf5_dataset

SECRET = b"OUTSIDE-THE-FILE-" * 64


@pytest.fixture
def crafted(tmp_path):
    """A file holding a plain dataset and one of every kind that reads elsewhere; the outside files beside it."""
    (tmp_path / "secret.bin").write_bytes(SECRET)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.frombuffer(SECRET, np.uint8)
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f["/g/plain"] = np.arange(10, dtype=np.float32)
        f.create_dataset("/g/external storage", (len(SECRET),), np.uint8,
                         external=[(str(tmp_path / "secret.bin"), 0, len(SECRET))])
        f["/g/external link"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
        f["/far"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/")
        f["/g/soft link"] = h5py.SoftLink("/far/x")
        f["/g/soft to group"] = h5py.SoftLink("/g")  # a soft link in the middle of a path
        layout = h5py.VirtualLayout((len(SECRET),), np.uint8)
        layout[...] = h5py.VirtualSource(str(tmp_path / "other.h5"), "x", (len(SECRET),))
        f.create_virtual_dataset("/g/virtual", layout)
        f.create_dataset("/g/gzip", data=np.arange(100), compression="gzip")
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(f.id, b"/g/compact", h5py.h5t.NATIVE_INT32, h5py.h5s.create_simple((4,)), dcpl=dcpl)
    return path


@pytest.mark.parametrize("name, reason", [
    ("/g/external storage", "external raw storage"), ("/g/external link", "an external link (/g/external link)"),
    ("/g/soft link", "a soft link (/g/soft link)"), ("/g/soft to group/plain", "a soft link (/g/soft to group)"),
    ("/g/virtual", "virtual dataset"), ("/g/gzip", "filter 1 ('deflate')"), ("/g/compact", "neither contiguous"),
    ("/g", "not a readable dataset"), ("g/plain", "absolute path"), ("/g//plain", "absolute path"),
    ("/g/./plain", "absolute path")])
def test_refuses_what_reads_elsewhere(crafted, name, reason) -> None:
    with h5py.File(crafted, "r") as f:
        with pytest.raises(ForeignData, match="t.h5': dataset .* " + reason.replace("(", r"\(").replace(")", r"\)")):
            hdf5_dataset(f, name, repr(str(crafted)))


def test_plain_datasets_open_and_missing_is_a_key_error(crafted) -> None:
    with h5py.File(crafted, "r") as f:
        assert h5py.Dataset(hdf5_dataset(f, "/g/plain", "t"))[3] == 3
        assert h5py.Dataset(hdf5_dataset(f, "/g/gzip", "t", HDF5_BUILTIN_FILTERS))[99] == 99  # files others wrote
        for missing in ("/g/none", "/none/plain"):
            with pytest.raises(KeyError):
                hdf5_dataset(f, missing, "t")
    e = pickle.loads(pickle.dumps(ForeignData("f.h5", "/a/b", "why")))  # crosses ranks inside DCP's errors
    assert str(e) == "f.h5: dataset '/a/b' why" and e.reason == "why"


@pytest.mark.faults
@pytest.mark.parametrize("kind", ["external raw storage", "external link", "virtual dataset"])
def test_token_file_reading_outside_is_refused(tmp_path, kind) -> None:
    (tmp_path / "secret.bin").write_bytes(SECRET)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.frombuffer(SECRET, np.uint8).view("<u2")
    n = len(SECRET) // 2
    with h5py.File(tmp_path / "tokens.h5", "w") as f:
        if kind == "external raw storage":
            f.create_dataset("tokens", (n,), "<u2", external=[(str(tmp_path / "secret.bin"), 0, len(SECRET))])
        elif kind == "external link":
            f["tokens"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
        else:
            layout = h5py.VirtualLayout((n,), "<u2")
            layout[...] = h5py.VirtualSource(str(tmp_path / "other.h5"), "x", (n,))
            f.create_virtual_dataset("tokens", layout)
    with pytest.raises(ValueError, match=f"'{tmp_path / 'tokens.h5'}': dataset '/tokens'"):
        HDF5Source(tmp_path / "tokens.h5")
    with h5py.File(tmp_path / "plain.h5", "w") as f:  # what data build writes still opens
        f.create_dataset("tokens", data=np.arange(300, dtype="<u2") % 256, chunks=(100,), compression="gzip")
    src = HDF5Source(tmp_path / "plain.h5")
    assert len(src) == 300 and src.read(298, 5).tolist() == [42, 43]
    record(f"HDF5 token file whose 'tokens' dataset reads another file ({kind})",
           "refused on opening with a ValueError naming the file and dataset", tier="pure")


@pytest.mark.parametrize("raw", [b"[" * 100_000, '{"lr": "\\ud800"}'.encode(), b"\xff", b"{"])
def test_a_stored_json_value_is_parsed_bounded(tmp_path, raw) -> None:
    """A checkpoint's non-tensor value (JSON in a dataset, after its crc32 matched): deep nesting, a lone surrogate,
    bad UTF-8 or bad JSON is CheckpointCorrupt naming the dataset, never a RecursionError or a string torch.save
    and later code cannot encode."""
    from hpctrain.checkpoint.hdf5_storage import CheckpointCorrupt, from_json

    with pytest.raises(CheckpointCorrupt, match="optimizer.param_groups.lr"):
        from_json(raw, (tmp_path / "shard-0.h5", "/optimizer.param_groups.lr/bytes"))
