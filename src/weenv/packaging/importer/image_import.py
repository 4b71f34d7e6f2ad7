"""``weenv import``: an existing image becomes layer groups and a template.

Steps, in order; no ref or template is published until every layer has been
read and verified, and a failure deletes whatever the import stored:

1. open the source (:func:`~weenv.packaging.importer.source.open_source`) and
   read its index, manifest and config, each checked against its digest;
2. map layers to groups (:func:`plan_groups`: one group per layer, or runs of
   small adjacent layers merged);
3. stream each group's layers, in order, into an inode tree, checking each
   layer's blob digest and diff_id as it streams, and write its EROFS image
   into a :class:`~weenv.packaging.chunksink.ChunkSink`, which stores the
   image's chunks as they are written (no image file); a group of one layer
   has its files' data written into the image as the layer streams in
   (:mod:`~weenv.packaging.importer.tartree`); then its manifest, by digest
   (``ref=False``).  (The old path, each group's layers applied to a
   directory tree and the image written from it, is kept in the benchmarks
   for comparison: ``weenv_bench.extracting_import``);
4. turn the image config into the template's runtime config
   (:mod:`~weenv.packaging.importer.runtime`; files of published groups are
   read back from the store);
5. publish the template, then the refs ``groups/NAME.K``.

Both paths give the same file trees; their images are byte-identical for
groups of several layers (both lay file data out in tree order), not for a
group of one layer on the streaming path (file data in the layer's order).
The import holds a write lease (:mod:`weenv.store.lease`) naming every chunk
and manifest it stores or finds stored, from before it asks the store until
its template and refs are published, so neither ``weenv gc`` nor another
import's rollback deletes them under it.  A failure in steps 1-4 deletes the
chunks and manifests the import stored that no one else relies on, and
removes the temporary files; a failure in step 5 leaves at most unreferenced
chunks and manifests (``weenv gc`` removes them), never a ref.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from weenv.errors import InvalidInputError
from weenv.formats.manifest import (
    DEFAULT_CHUNK_SIZE,
    RuntimeConfig,
    TemplateManifest,
    check_name,
)
from weenv.packaging.chunksink import ChunkSink
from weenv.packaging.erofs_writer import WRITER, write_image
from weenv.packaging.gc import published_digests
from weenv.packaging.group import BuildResult, group_uuid, publish_sink
from weenv.packaging.importer import tartree
from weenv.packaging.importer.layers import LayerStats, open_layer
from weenv.packaging.importer.runtime import runtime_from_config
from weenv.packaging.importer.source import Image, ImageSource, open_source
from weenv.packaging.layout import image_reader
from weenv.packaging.template import create_template
from weenv.progress import QUIET, Progress
from weenv.store.base import Store
from weenv.store.lease import Lease, LeasedStore, delete_unused

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_image` published."""

    template_digest: str
    template: TemplateManifest
    groups: list[BuildResult]
    """One per group, bottom to top."""
    group_layers: list[list[int]]
    """Layer indexes (bottom = 0) of each group."""
    layer_stats: list[LayerStats]
    """Per layer, bottom to top."""
    seconds: float


def plan_groups(layer_sizes: list[int], merge_small: int | None = None) -> list[list[int]]:
    """Layer indexes per group, bottom to top.

    Without ``merge_small``: one group per layer.  With ``merge_small = B``
    (bytes): a layer of at least ``B`` bytes has a group of its own; runs of
    adjacent layers smaller than ``B`` share a group for as long as their total
    stays at most ``B``.  Sizes are the layer blobs' as stored (compressed in
    registries and OCI layouts, plain tars in ``docker save`` archives).
    """
    if merge_small is None:
        return [[i] for i in range(len(layer_sizes))]
    if merge_small <= 0:
        raise InvalidInputError(f"merge-small must be a positive byte count, not {merge_small}")
    groups: list[list[int]] = []
    run_total = 0
    open_run = False
    for i, size in enumerate(layer_sizes):
        if size >= merge_small:
            groups.append([i])
            open_run = False
        elif open_run and run_total + size <= merge_small:
            groups[-1].append(i)
            run_total += size
        else:
            groups.append([i])
            run_total, open_run = size, True
    return groups


def default_name(source: str) -> str:
    """A template name from a source: the repository's or file's base name,
    lowercased, without tag or extension, other characters as ``-``."""
    base = source.rstrip("/")
    if base.startswith("docker://"):
        base = base[len("docker://") :].split("@", 1)[0]
        last = base.rsplit("/", 1)[-1]
        base = last.split(":", 1)[0]
    else:
        base = Path(base).name
        for ext in (".tar.gz", ".tgz", ".tar.zst", ".tar", ".oci"):
            if base.endswith(ext):
                base = base[: -len(ext)]
                break
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in base.lower()).strip("-._")
    return name[:120] or "image"


def import_image(
    source: str,
    store: Store,
    *,
    name: str | None = None,
    ref: str | None = None,
    merge_small: int | None = None,
    insecure: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workdir: str | os.PathLike[str] | None = None,
    progress: Progress = QUIET,
) -> ImportResult:
    """Import the image at ``source`` (an OCI layout directory, a ``docker save``
    or OCI archive, or ``docker://HOST/REPO:TAG``) into ``store`` as groups
    ``NAME.0`` .. ``NAME.K`` (bottom to top) and template ``NAME``.

    ``name``: template name (default from the source, :func:`default_name`).
    ``ref``: which image of a layout or archive holding several (an OCI
    ``org.opencontainers.image.ref.name`` or a docker ``RepoTags`` entry).
    ``merge_small``: bytes, see :func:`plan_groups`.  ``insecure``: reach a
    non-loopback registry without TLS verification.  ``workdir``: parent of the
    temporary files (the old path's trees, about the image's unpacked size;
    the streaming path's spool of a merged group's data; default the
    system's temporary directory).  ``progress`` hears the tasks ``layers``,
    ``bytes`` (the layers' stored sizes) and ``groups`` move on.
    Layers stream into the image writer
    (:mod:`~weenv.packaging.importer.tartree`) and images into the store (the
    old extracting path, for comparison, is the benchmarks'
    ``weenv_bench.extracting_import``).

    Raises :class:`InvalidInputError` (bad source, name or image; truncated or
    corrupt archive or layer; missing blob; unsafe layer entry),
    :class:`DigestMismatchError` (a blob or layer whose digest or size is not
    its descriptor's), :class:`NotFoundError` (no such path, ref or registry
    image), :class:`ToolMissingError` (no skopeo),
    :class:`RuntimeFailedError` (skopeo failed).
    """
    started = time.monotonic()
    name = check_name(name or default_name(source))
    with open_source(source, insecure=insecure) as src:
        image = src.read_image(ref)
        progress.say(f"{image.reference}: {len(image.layers)} layers, config {image.config_digest[:19]}")
        plan, names = plan_image(src, image, name, merge_small)
        tmp = Path(tempfile.mkdtemp(dir=workdir, prefix="weenv-import-"))
        with Lease(store, what=f"import {name}") as lease:
            leased = LeasedStore(store, lease)
            try:
                results, stats, runtime = _import_streamed(src, image, plan, names, leased, chunk_size, tmp, progress)
            finally:
                _rmtree(tmp)
            return _finish(leased, name, names, results, runtime, plan, stats, started)


def plan_image(src: ImageSource, image: Image, name: str, merge_small: int | None) -> tuple[list[list[int]], list[str]]:
    """The groups of ``image`` (:func:`plan_groups`) and their names ``NAME.K``, checked."""
    if not image.layers:
        raise InvalidInputError(f"{image.reference}: the image has no layers")
    plan = plan_groups([_layer_size(src, layer) for layer in image.layers], merge_small)
    names = [check_name(f"{name}.{k}") for k in range(len(plan))]
    return plan, names


def _finish(
    store: LeasedStore,
    name: str,
    names: list[str],
    results: list[BuildResult],
    runtime: RuntimeConfig,
    plan: list[list[int]],
    stats: list[LayerStats],
    started: float,
) -> ImportResult:
    """Publish the template, then the groups' refs (while the import's lease
    still holds: a lease lost meanwhile may have let gc take what they name)."""
    store.lease.check()
    digest, manifest = create_template(store, name, [r.digest for r in results], runtime=runtime)
    for group_name, r in zip(names, results):
        store.set_ref("groups", group_name, r.digest)
    return ImportResult(digest, manifest, results, plan, stats, time.monotonic() - started)


def _import_streamed(
    src: ImageSource,
    image: Image,
    plan: list[list[int]],
    names: list[str],
    store: LeasedStore,
    chunk_size: int,
    tmp: Path,
    progress: Progress,
) -> tuple[list[BuildResult], list[LayerStats], RuntimeConfig]:
    """The streaming path (:mod:`~weenv.packaging.importer.tartree`): each
    group's layers merged into an inode tree, its image written into a
    :class:`~weenv.packaging.chunksink.ChunkSink` (stored chunk by chunk as it
    is written, never a file) and its chunks and manifest published by digest
    as soon as its layers are verified.  A group of one layer has its file
    data written into the image as it streams in; a group of several spools
    it under ``tmp`` (a later layer may delete it).  Lower groups' files
    (hardlinks from above, ``/etc/passwd`` for the runtime config) are read
    back from the store.  On any failure the chunks and manifests this import
    wrote (that the store did not hold before) are deleted again, but those
    another writer's lease names or a ref reaches (:func:`_roll_back`).  Returns the groups' build results, per-layer stats
    and the runtime config."""
    started = time.monotonic()
    view = tartree.View()
    stats: list[LayerStats] = []
    results: list[BuildResult] = []
    written: list[str] = []  # chunks this import stored, for the rollback
    sizes = [_layer_size(src, layer) for layer in image.layers]
    progress.start("layers", total=len(image.layers))
    progress.start("bytes", total=sum(sizes), unit="B")
    progress.start("groups", total=len(plan))
    try:
        for k, layer_indexes in enumerate(plan):
            with contextlib.ExitStack() as group:
                sink = group.enter_context(ChunkSink(store, chunk_size))
                group.callback(lambda s=sink: written.extend(s.abort()))  # what it stored, for a rollback
                if len(layer_indexes) == 1:
                    merger = tartree.TreeMerger(view, image=sink)
                else:
                    spool = tartree.Spool(tmp)
                    group.callback(spool.close)
                    merger = tartree.TreeMerger(view, spool=spool)
                for i in layer_indexes:
                    layer = image.layers[i]
                    what = f"{image.reference}: layer {i} ({layer.digest or layer.diff_id})"
                    with open_layer(src, layer, what, read_ahead=True) as tar:
                        stats.append(merger.apply_layer(tar, what))
                    src.release(layer.location)
                    progress.advance("bytes", sizes[i])
                    progress.advance(
                        "layers",
                        status=f"layer {i}: {stats[-1].entries} entries, {stats[-1].whiteouts} whiteouts, "
                        f"{stats[-1].opaque_dirs} opaque dirs",
                    )
                scan = write_image(
                    merger.root, sink, uuid=group_uuid(names[k], "latest"), placed_blocks=merger.placed_blocks
                )
                result = publish_sink(
                    sink,
                    store,
                    name=names[k],
                    file_count=scan.inodes,
                    ref=False,
                    started=started,
                    source={
                        "type": "image",
                        "mkfs": WRITER,
                        "image": image.reference,
                        "config": image.config_digest,
                        "layers": ",".join(image.layers[i].diff_id for i in layer_indexes),
                    },
                )
                results.append(result)
                progress.advance(
                    "groups", status=f"{names[k]}: layers {layer_indexes[0]}..{layer_indexes[-1]} published"
                )
            tartree.release(merger.root, image_reader(store, result.manifest, keep=False))
            view.apply_group(merger.root)
        runtime = runtime_from_config(image.config, view.read_file)
    except BaseException:
        for task in ("layers", "bytes", "groups"):
            progress.finish(task, status="failed", failed=True)
        _roll_back(store, written, [r.digest for r in results if r.new_manifest])
        raise
    for task in ("layers", "bytes", "groups"):
        progress.finish(task)
    return results, stats, runtime


def _roll_back(store: LeasedStore, chunks: list[str], manifests: list[str]) -> None:
    """Delete what a failed import wrote, but what another import or build
    relies on (its lease names it: it found it stored and did not write it
    again) or a ref reaches (someone published it meanwhile); the order that
    makes this safe is :mod:`weenv.store.lease`'s.  A failure here leaves
    unreferenced blobs for ``weenv gc``."""
    try:
        delete_unused(
            store.inner,
            {"manifests": manifests, "chunks": chunks},
            reached=lambda: published_digests(store.inner),
            what="import rollback",
            exclude=store.lease.id,
        )
    except Exception as exc:  # noqa: BLE001 - the import's own error is the one to raise
        log.warning("rollback of an import left blobs in %s for gc: %s", store.url, exc)


def _layer_size(src: ImageSource, layer) -> int:
    if layer.size is not None:
        return layer.size
    return src.blob_size(layer.location)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
