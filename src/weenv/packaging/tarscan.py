"""A streaming check of a COPY upload (a tar, gzip-compressed or not), made as
its bytes arrive and again before :mod:`tarfile` opens it.

Python's ``tarfile`` reads a PAX extended header (``x``, ``g``) or a GNU long
name / long link (``L``, ``K``) whole, with one ``read`` of the size its
header declares: an upload declaring a 1 GiB header makes the daemon hold
1 GiB.  :class:`TarScan` walks the archive's headers itself, block by block,
and refuses such a header *before* its body is read: at most
:data:`~weenv.formats.limits.MAX_TAR_HEADER_BYTES` are ever buffered.

To be sure that the archive ``tarfile`` later reads is the one checked, the
scan follows ``tarfile``'s own walk (its header parser,
:meth:`tarfile.TarInfo.frombuf`, on each 512-byte block; member data skipped
as ``tarfile`` skips it, a PAX ``size`` applied to the member it precedes)
and refuses what it would have to guess at: sparse members (``S``, PAX
``GNU.sparse.*``), Solaris ``X`` headers, types ``tarfile`` does not know,
two PAX headers for one member, a global header setting ``size``, a PAX
record that is not well formed, negative sizes, a second gzip member before
the archive's end.  It also holds the archive to ``max_entries`` members and
``max_bytes`` bytes of regular files (a gzip bomb stops there, while it
arrives).  After the archive's end (a zero block or, as ``tarfile`` has it,
an unreadable header past the first), nothing more is decompressed.

Errors: :class:`~weenv.errors.InvalidInputError`, one line saying what was refused.
"""

from __future__ import annotations

import re
import tarfile
import zlib
from pathlib import Path

from weenv.errors import InvalidInputError
from weenv.formats.limits import MAX_TAR_HEADER_BYTES

BLOCK = tarfile.BLOCKSIZE
_EXTENDED = {
    tarfile.XHDTYPE: "PAX extended",
    tarfile.XGLTYPE: "PAX global",
    tarfile.GNUTYPE_LONGNAME: "GNU long name",
    tarfile.GNUTYPE_LONGLINK: "GNU long link",
}
_MEMBER_TYPES = set(tarfile.SUPPORTED_TYPES) - {tarfile.GNUTYPE_SPARSE, *_EXTENDED}
_RECORD = re.compile(rb"([0-9]+) ([^=]+)=")
MAX_SPARSE_ENTRIES = 1 << 16
"""Most (offset, size) pairs of one GNU sparse member's map (``tarfile`` holds them all)."""
_OUT_STEP = 1 << 20
"""Most bytes one decompression call produces (a gzip bomb is inflated a MiB at a time)."""


def _blocks(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


class TarScan:
    """Feed it the upload's bytes (:meth:`feed`), then :meth:`finish`.  See the module docstring."""

    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        max_header: int = MAX_TAR_HEADER_BYTES,
        what: str = "the COPY upload",
        sparse: bool = False,
        compressed: bool | None = None,
    ):
        """``what`` names the archive in errors.  ``sparse``: take GNU sparse
        members (type ``S`` with at most ``max_header`` bytes of extension
        headers, PAX ``GNU.sparse.*`` 0.x and 1.0 with a map of at most
        :data:`MAX_SPARSE_ENTRIES` entries); refused otherwise.
        ``compressed=False``: the bytes are the tar itself (no gzip sniffing)."""
        self.max_entries, self.max_bytes, self.max_header = max_entries, max_bytes, max_header
        self.what, self.sparse = what, sparse
        self.entries = 0
        """Members seen so far (extended headers not counted)."""
        self.file_bytes = 0
        """Bytes of regular files seen so far (their headers' sizes)."""
        self.gzip: bool | None = None if compressed is None else bool(compressed)
        """Whether the upload is gzip-compressed (None until its first two bytes came)."""
        self._head = b""
        self._inflate = None
        self._gzip_done = False
        self.ended = False
        """Whether the archive's end was seen (nothing after it is read)."""
        self._offset = 0  # of the tar stream, decompressed
        self._buf = bytearray()
        self._need = BLOCK
        self._skip = 0
        self._extended: bytes | None = None  # the type of the extended header whose body is being read
        self._chain: list[bytes] = []
        self._pax_size: int | None = None
        self._sparse_ext = 0  # GNU sparse extension blocks read for the member under way
        self._sparse_data: int | None = None  # its data's size, skipped after the extension blocks
        self._sparse_map = False  # the next data block starts a GNU sparse 1.0 map
        self._sparse_rest = 0  # the 1.0 member's data after its map's first block

    # --- the compressed stream -------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Check the next bytes of the upload; raises :class:`InvalidInputError`."""
        if self.ended or not data:
            return
        if self.gzip is None:
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, b""
            self.gzip = data[:2] == b"\x1f\x8b"
            if self.gzip:
                self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        if not self.gzip:
            self._tar(data)
            return
        if self._gzip_done:
            if data.strip(b"\0"):
                raise InvalidInputError(f"{self.what} holds a second gzip stream before its tar ends")
            return
        pending = data
        while pending and not self.ended:
            try:
                out = self._inflate.decompress(pending, _OUT_STEP)
            except zlib.error as exc:
                raise InvalidInputError(f"{self.what} is not a readable gzip stream: {exc}") from None
            pending = self._inflate.unconsumed_tail
            self._tar(out)
            if self._inflate.eof:
                self._gzip_done = True
                if not self.ended:
                    self.feed(self._inflate.unused_data)
                return

    def finish(self) -> None:
        """The upload is whole: raises :class:`InvalidInputError` unless its tar ended."""
        if self.gzip is None and self._head:
            raise InvalidInputError(f"{self.what} is not a tar (too short)")
        if not self.ended:
            if self._offset < BLOCK:
                raise InvalidInputError(f"{self.what} is not a tar: {self._offset} bytes, less than one header")
            raise InvalidInputError(f"{self.what} ends before its tar does (truncated)")

    # --- the tar stream --------------------------------------------------------------------
    def _tar(self, data: bytes) -> None:
        view, pos = memoryview(data), 0
        while pos < len(view) and not self.ended:
            if self._skip:
                n = min(self._skip, len(view) - pos)
                self._skip -= n
                pos += n
                self._offset += n
                continue
            n = min(self._need - len(self._buf), len(view) - pos)
            self._buf += view[pos : pos + n]
            pos += n
            self._offset += n
            if len(self._buf) == self._need:
                block = bytes(self._buf)
                self._buf.clear()
                self._need = BLOCK
                if self._sparse_data is not None:
                    self._sparse_extension(block)
                elif self._extended is not None:
                    self._extended_body(block)
                else:
                    self._header(block, self._offset - BLOCK)

    def _header(self, block: bytes, at: int) -> None:
        if block.count(0) == BLOCK:
            if self._chain:
                raise InvalidInputError(f"{self.what}: its tar ends right after an extended header")
            self.ended = True
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            if at == 0 or self._chain:
                raise InvalidInputError(f"{self.what} is not a readable tar: {exc}") from None
            self.ended = True  # as tarfile: an unreadable header past the first ends the archive
            return
        kind = info.type
        if kind in _EXTENDED:
            if info.size < 0 or info.size > self.max_header:
                raise InvalidInputError(
                    f"{self.what} has a {_EXTENDED[kind]} header of {info.size} bytes at offset {at} "
                    f"(at most {self.max_header} are taken)"
                )
            if kind == tarfile.XHDTYPE and tarfile.XHDTYPE in self._chain:
                raise InvalidInputError(f"{self.what} has two PAX extended headers for one member")
            self._chain.append(kind)
            self._extended = kind
            self._need = _blocks(info.size)
            if self._need == 0:
                self._need = BLOCK
                self._extended_body(b"")
            return
        if kind == tarfile.GNUTYPE_SPARSE and self.sparse:
            self._chain, self._pax_size = [], None
            self._count(info, info.size)
            self._sparse_data = info.size
            if not info._sparse_structs[1]:  # no extension headers
                self._sparse_extension(None)
            return
        if kind not in _MEMBER_TYPES:
            raise InvalidInputError(f"{self.what} has a member of type {kind!r} (sparse or unknown: not taken)")
        size = self._pax_size if self._pax_size is not None else info.size
        if size < 0:
            raise InvalidInputError(f"{self.what} has a member of negative size at offset {at}")
        self._chain, self._pax_size = [], None
        self._count(info, size)
        if info.isreg():
            self._skip = _blocks(size)
            if self._sparse_map and size:
                self._sparse_rest, self._skip = self._skip - BLOCK, 0
                self._sparse_data = -1  # the map's first block comes next
        self._sparse_map = False

    def _count(self, info: tarfile.TarInfo, size: int) -> None:
        self.entries += 1
        if info.isreg() or info.type == tarfile.GNUTYPE_SPARSE:
            self.file_bytes += size
        if self.entries > self.max_entries or self.file_bytes > self.max_bytes:
            raise InvalidInputError(f"{self.what} holds more than {self.max_entries} entries or {self.max_bytes} bytes")

    def _extended_body(self, body: bytes) -> None:
        kind, self._extended = self._extended, None
        if kind not in (tarfile.XHDTYPE, tarfile.XGLTYPE):
            return  # a long name or link: its bytes only name the next member
        records = _pax_records(body, self.what)
        if self.sparse and kind == tarfile.XHDTYPE:
            self._sparse_pax(records)
        elif any(k.startswith(b"GNU.sparse") for k in records):
            raise InvalidInputError(f"{self.what} has a sparse member (GNU.sparse PAX records): not taken")
        if b"size" in records:
            if kind == tarfile.XGLTYPE:
                raise InvalidInputError(f"{self.what} has a PAX global header setting 'size'")
            try:
                self._pax_size = int(records[b"size"].decode("utf-8", "surrogateescape"))
            except ValueError:
                self._pax_size = 0  # as tarfile

    # --- GNU sparse members (only with ``sparse=True``) ----------------------------------------
    def _sparse_extension(self, block: bytes | None) -> None:
        """One extension block of an ``S`` member (``None``: there are none),
        or (``_sparse_data == -1``) the first data block of a 1.0 member's map."""
        if self._sparse_data == -1:
            self._sparse_data, self._skip = None, self._sparse_rest
            head = block.split(b"\n", 1)[0]
            if not head.isdigit() or int(head) > MAX_SPARSE_ENTRIES:
                raise InvalidInputError(
                    f"{self.what} has a GNU sparse map of {head[:20]!r} entries "
                    f"(at most {MAX_SPARSE_ENTRIES} are taken)"
                )
            return
        if block is not None:
            self._sparse_ext += 1
            if self._sparse_ext * BLOCK > self.max_header:
                raise InvalidInputError(
                    f"{self.what} has a GNU sparse member with more than {self.max_header} bytes of extension headers"
                )
            if block[504]:  # isextended: another extension block follows
                return
        self._skip, self._sparse_data, self._sparse_ext = _blocks(self._sparse_data), None, 0

    def _sparse_pax(self, records: dict[bytes, bytes]) -> None:
        """PAX ``GNU.sparse.*`` records: the 0.x map is in the header (bounded by
        ``max_header``); a 1.0 map starts the member's data and is checked there."""
        if records.get(b"GNU.sparse.major") == b"1":
            self._sparse_map = True
        count = records.get(b"GNU.sparse.numblocks")
        if count is not None and (not count.isdigit() or int(count) > MAX_SPARSE_ENTRIES):
            raise InvalidInputError(
                f"{self.what} has a GNU sparse map of {count[:20]!r} entries (at most {MAX_SPARSE_ENTRIES} are taken)"
            )


def _pax_records(body: bytes, what: str = "the COPY upload") -> dict[bytes, bytes]:
    """The ``LENGTH KEYWORD=VALUE\\n`` records of a PAX header's ``body`` (NUL
    padding after them); :class:`InvalidInputError` unless each is well formed,
    so that every ``tarfile`` version reads the same records."""
    records, pos = {}, 0
    end = len(body.rstrip(b"\0"))
    while pos < end:
        m = _RECORD.match(body, pos)
        length = int(m.group(1)) if m else 0
        if m is None or length <= m.end() - pos or pos + length > end or body[pos + length - 1] != 0x0A:
            raise InvalidInputError(f"{what} has a malformed PAX record at byte {pos} of its header")
        records[m.group(2)] = body[m.end() : pos + length - 1]
        pos += length
    return records


def scan_file(path: Path, *, max_entries: int, max_bytes: int) -> bool:
    """Check the upload at ``path`` as :class:`TarScan` does; whether it is gzip-compressed."""
    scan = TarScan(max_entries=max_entries, max_bytes=max_bytes)
    with open(path, "rb") as f:
        while (chunk := f.read(1 << 20)) and not scan.ended:
            scan.feed(chunk)
    scan.finish()
    return bool(scan.gzip)
