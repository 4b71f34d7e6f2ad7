"""The ``filesHash`` of a COPY step, computed from its upload, to check the
upload is the files the SDK hashed.

The ``e2b`` SDK (``e2b/template/utils.py``, ``calculate_files_hash``) hashes
the files, not the tar it uploads: sha256 over ``COPY {src} {dest}``, then for
each file of the copy (sorted, the same list and order it tars) its path
relative to the context directory, ``str(st_mode)``, ``str(st_size)`` (not for
directories), then a symbolic link's target (links not followed) or a
regular file's bytes.  uid, gid and mtime are left out.  The tar holds every
one of these: a member's name is that relative path, its permission bits are
``st_mode & 0o7777`` and its type gives the rest of ``st_mode``, a link's
``st_size`` is the length of its target, a hard link (the SDK's tar stores a
second name of one inode as one) has the size and bytes of the member it
links to.  So :func:`files_hash` recomputes the SDK's hash from the upload
alone, given the step's ``src`` and ``dest``; what it cannot see: sockets in
the context (the SDK hashes them, ``tarfile`` skips them), so a context
holding one never matches.

The upload's name is its ``filesHash`` but the upload link does not say which
COPY it is for (``src`` and ``dest`` are hashed first), so the check is made
where a build uses the upload, not as it arrives.
"""

from __future__ import annotations

import hashlib
import stat
import tarfile

from weenv.errors import InvalidInputError

_TYPE_BITS = {
    tarfile.DIRTYPE: stat.S_IFDIR,
    tarfile.SYMTYPE: stat.S_IFLNK,
    tarfile.FIFOTYPE: stat.S_IFIFO,
    tarfile.CHRTYPE: stat.S_IFCHR,
    tarfile.BLKTYPE: stat.S_IFBLK,
}


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def files_hash(tar: tarfile.TarFile, members: list[tarfile.TarInfo], src: str, dest: str, *, max_bytes: int) -> str:
    """The SDK's ``filesHash`` (64 lowercase hex digits) of the COPY ``src``
    ``dest`` whose upload ``tar`` (opened for reading, random access) holds
    ``members`` (in the archive's order).  Reads at most ``max_bytes`` of file
    contents (a hard link's target counted again, as the SDK hashes it again);
    raises :class:`InvalidInputError` past that, or for a hard link to a member
    that is not an earlier regular file."""
    h = hashlib.sha256(_utf8(f"COPY {src} {dest}"))
    regular: dict[str, tarfile.TarInfo] = {}
    read = 0
    for m in members:
        h.update(_utf8(m.name))
        perm = m.mode & 0o7777
        if m.issym():
            target = _utf8(m.linkname)
            h.update(b"%d%d" % (stat.S_IFLNK | perm, len(target)))
            h.update(target)
            continue
        if m.isdir():
            h.update(b"%d" % (stat.S_IFDIR | perm))
            continue
        if not (m.isreg() or m.islnk()):
            h.update(b"%d0" % (_TYPE_BITS.get(m.type, 0) | perm))
            continue
        data = m
        if m.islnk():
            data = regular.get(m.linkname)
            if data is None:
                raise InvalidInputError(f"the COPY upload's hard link {m.name!r} names no earlier file")
        else:
            regular[m.name] = m
        h.update(b"%d%d" % (stat.S_IFREG | perm, data.size))
        read += data.size
        if read > max_bytes:
            raise InvalidInputError(f"the COPY upload's files hold more than {max_bytes} bytes")
        f = tar.extractfile(data)
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
