"""Reading files this process did not write: whatever lies in a run directory, a checkpoint, a data directory or a
Hugging Face directory may be damaged, crafted or huge. Every read here is bounded and every refusal is an
`Untrusted` error (a ValueError) that names the file and what is wrong with it.

    raw = read_bytes(path, 1 << 20)                    # a regular file, not a link, at most 1 MiB
    raw = read_bytes(path, 64 << 20, tail=True)        # its last 64 MiB, however large it is
    obj = read_json(path, 1 << 20)                     # parsed: nested at most MAX_DEPTH deep, no lone surrogates
    obj = parse_json(line, "metrics.jsonl line 7")     # the same checks on text already read (a JSON line)
    dsid = hdf5_dataset(h5file, "/group/leaf", "'shard-0.h5'")  # a dataset whose bytes all lie in that file

An HDF5 file can make a reader fetch bytes from elsewhere: a soft, external or user-defined link on a dataset's
path, external raw storage (the data is another file's bytes, /etc/passwd as well as any), a virtual dataset
(mapped from datasets of other files), or a filter the library lacks (loaded from a plugin library). hdf5_dataset
checks each before anything of the dataset is read.

A lone surrogate ("\\ud800" escaped in JSON) parses into a Python str that cannot be encoded again: it would fail
later, far from the file, as a traceback. JSON nested deeper than the interpreter's recursion limit raises
RecursionError inside json; nesting is bounded far below that. Imports nothing of hpctrain and no torch.
Tests: pytest tests/pure/test_untrusted.py tests/pure/test_untrusted_hdf5.py
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Collection

__all__ = ["Untrusted", "MAX_DEPTH", "read_bytes", "read_json", "parse_json", "ForeignData", "HDF5_BUILTIN_FILTERS",
           "hdf5_dataset"]

MAX_DEPTH = 64  # nesting of any JSON file we read: ours are a few levels deep


class Untrusted(ValueError):
    """A file (or a value read from one) that is missing, a link, too large, or not what it claims to be."""


def read_bytes(path: str | os.PathLike, limit: int, *, tail: bool = False) -> bytes:
    """The bytes of a regular file that is not a symbolic link, at most `limit` of them. A larger file is refused,
    or with tail=True only its last `limit` bytes are read. A FIFO or device never blocks the read: refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Untrusted(f"{str(path)!r} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(f"{str(path)!r} is a symbolic link: not followed") from None
        raise Untrusted(f"{str(path)!r} cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{str(path)!r} is not a regular file")
        if st.st_size > limit:
            if not tail:
                raise Untrusted(f"{str(path)!r} is {st.st_size} bytes, more than the {limit} such a file may hold")
            os.lseek(fd, st.st_size - limit, os.SEEK_SET)
        chunks, left = [], limit + 1  # one byte more: a file that grew since fstat is refused too
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise Untrusted(f"{str(path)!r} cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        if tail:
            return data[-limit:]
        raise Untrusted(f"{str(path)!r} grew past {limit} bytes while it was read")
    return data


def _check_tree(value: Any, where: str, depth: int) -> None:
    """Nesting at most `depth` deep; every string (values and keys) encodable as UTF-8."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise Untrusted(f"{where}: a string holds a lone surrogate ({v[:40]!r})") from None
        elif isinstance(v, (list, dict)):
            if d > depth:
                raise Untrusted(f"{where}: JSON nested more than {depth} deep")
            if isinstance(v, dict):
                stack.extend((k, d) for k in v)
                stack.extend((x, d + 1) for x in v.values())
            else:
                stack.extend((x, d + 1) for x in v)


def parse_json(data: bytes | str, where: str, depth: int = MAX_DEPTH) -> Any:
    """JSON text (bytes are UTF-8) parsed and checked: nested at most `depth` deep, no lone surrogates. `where`
    names the source in the Untrusted error."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        value = json.loads(text)
    except UnicodeDecodeError as e:
        raise Untrusted(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise Untrusted(f"{where}: JSON nested more than {depth} deep") from None
    except ValueError as e:
        raise Untrusted(f"{where}: not JSON ({e})") from None
    _check_tree(value, where, depth)
    return value


def read_json(path: str | os.PathLike, limit: int, depth: int = MAX_DEPTH) -> Any:
    """A JSON file read with read_bytes(path, limit) and parsed with parse_json."""
    return parse_json(read_bytes(path, limit), repr(str(Path(path))), depth)


class ForeignData(Untrusted):
    """An HDF5 dataset whose bytes would not come from its own file: where (the file, as the caller names it),
    the dataset's path, and why."""

    def __init__(self, where: str, dataset: str, reason: str):
        super().__init__(where, dataset, reason)  # args as given, so it pickles
        self.where, self.dataset, self.reason = where, dataset, reason

    def __str__(self) -> str:
        return f"{self.where}: dataset {self.dataset!r} {self.reason}"


# Filters compiled into the HDF5 library (deflate, shuffle, fletcher32, szip, nbit, scaleoffset) and LZF, which
# h5py registers itself: none of them loads a plugin library
HDF5_BUILTIN_FILTERS = frozenset({1, 2, 3, 4, 5, 6, 32000})


def hdf5_dataset(f: Any, name: str, where: str, filters: Collection[int] = ()) -> Any:
    """Dataset `name` ("/group/leaf") of the open h5py File `f`, as h5py's low-level DatasetID, once it is known
    to hold its data in this file: every link on its path is a hard link (a soft, external or user-defined link
    is refused, not followed), its layout is contiguous or chunked (not virtual, not compact), it has no external
    raw storage, and no filter outside `filters` (filter ids: none by default, HDF5_BUILTIN_FILTERS for files
    others wrote). Nothing of the dataset's data is read. KeyError when the path does not exist; ForeignData
    naming `where`, the dataset and the reason otherwise."""
    import h5py  # here: the JSON readers above need no HDF5

    parts = name.split("/")
    if parts[0] != "" or len(parts) < 2 or any(p in ("", ".", "..") for p in parts[1:]):
        raise ForeignData(where, name, "is not an absolute path of plain names")
    link_kinds = {h5py.h5l.TYPE_SOFT: "a soft link", h5py.h5l.TYPE_EXTERNAL: "an external link"}
    path = b""
    for part in parts[1:]:
        # one component at a time: each lookup traverses only links already found to be hard
        path += b"/" + part.encode()
        if not f.id.links.exists(path):
            raise KeyError(f"{where}: no {path.decode()!r}")
        kind = f.id.links.get_info(path).type
        if kind != h5py.h5l.TYPE_HARD:
            what = link_kinds.get(kind, f"a user-defined link (type {kind})")
            raise ForeignData(where, name, f"is reached through {what} ({path.decode()}): not followed")
    try:
        dsid = h5py.h5d.open(f.id, name.encode())
    except (KeyError, OSError, RuntimeError, ValueError) as e:  # a group, or a damaged object header
        raise ForeignData(where, name, f"is not a readable dataset ({e})") from None
    dcpl = dsid.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5py.h5d.VIRTUAL:
        raise ForeignData(where, name, "is a virtual dataset (mapped from other datasets, possibly in other files)")
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED):
        raise ForeignData(where, name, f"has storage layout {layout}, neither contiguous nor chunked")
    if dcpl.get_external_count():
        raise ForeignData(where, name, f"has external raw storage: its bytes are those of the file "
                                       f"{os.fsdecode(dcpl.get_external(0)[0])!r}")
    for i in range(dcpl.get_nfilters()):
        code, _, _, fname = dcpl.get_filter(i)
        if code not in filters:
            raise ForeignData(where, name, f"is stored through filter {code} ({fname.decode(errors='replace')!r}), "
                                           f"which this reader does not apply (a filter HDF5 lacks is loaded from a "
                                           f"plugin library)")
    return dsid
