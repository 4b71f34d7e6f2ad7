"""E2B's template API (what the ``e2b`` SDK's ``Template`` / ``AsyncTemplate`` call),
over :class:`weenv.server.e2b.builds.Templates`.

Endpoints (paths and JSON as in E2B's public ``spec/openapi.yml``)::

    GET    /templates/aliases/{alias}                 -> TemplateAliasResponse (404 if unknown; an E2B
                                                      template's name, or a template of the node's store)
    POST   /v3/templates                              TemplateBuildRequestV3 -> 202 TemplateRequestResponseV3
    GET    /templates/{id}/files/{hash}               -> 201 TemplateBuildFileUpload (present, url, headers)
    PUT    /templates/{id}/files/{hash}/upload        the COPY's tar (weenv's upload link; token header)
    POST   /v2/templates/{id}/builds/{buildID}        TemplateBuildStartV2 -> 202
    GET    /templates/{id}/builds/{buildID}/status?logsOffset=&limit=&level=
                                                      -> TemplateBuildInfo (logEntries paged, reason)
    GET    /templates/{id}/builds/{buildID}/logs?cursor=&pageCursor=&limit=&direction=&level=&source=
                                                      -> TemplateBuildLogsResponse (logs, nextCursor)
    GET    /templates                                 -> [Template]
    GET    /v2/templates?limit=&nextToken=            -> [Template], header X-Next-Token
    PATCH  /templates/{id}, /v2/templates/{id}        TemplateUpdateRequest {public} -> 200
                                                      (v2: TemplateUpdateResponse {names})
    GET    /templates/{id}                            -> TemplateWithBuilds
    DELETE /templates/{id}                            -> 204 (cancels its builds, waits until undone)
    GET    /templates/{id}/tags                       -> [TemplateTag]
    POST   /templates/tags, DELETE /templates/tags    assign / remove tags
    GET    /weenv/templates/{ref}                     -> {"templateID", "template"}: weenv's own, the
                                                      weenv template digest a create of ``ref`` (ID, NAME,
                                                      NAME:TAG, NAME:BUILD_ID) starts here (a cluster's
                                                      gateway asks it of the node holding the template)

Every route but the upload needs the API key (the router's dependency); the
upload needs the token the files route handed out (``X-Weenv-Upload-Token``),
since the SDK sends the upload to the link without its key; the token lives an
hour and opens that one route only (:mod:`weenv.server.e2b.uploads`, which also
checks the upload as it arrives and removes it once no build needs it).  ``{id}`` is the
template id or, as E2B accepts, its name.
"""

from __future__ import annotations

import datetime
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import AliasChoices, Field, ValidationError

from weenv.build.stepbuild import BuildSpec
from weenv.errors import InvalidInputError, NotFoundError
from weenv.packaging.steps import MAX_STEPS, Step, check_steps
from weenv.server.e2b.api import ENVD_VERSION, E2BError, _Body
from weenv.server.e2b.builds import Build, TemplateRecord, Templates
from weenv.server.kit.paging import next_token_of, page_start

UPLOAD_HEADER = "x-weenv-upload-token"


class TemplateBuildRequestV3(_Body):
    name: str | None = Field(default=None, max_length=300)
    alias: str | None = Field(default=None, max_length=300)
    tags: list[str] = Field(default_factory=list, max_length=64)
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=1, le=1024)
    memory_mb: int | None = Field(default=None, alias="memoryMB", ge=128, le=1 << 24)
    min_free_disk_mb: int | None = Field(
        default=None, validation_alias=AliasChoices("minFreeDiskMb", "minFreeDiskMB"), ge=0, le=1 << 40
    )
    """MiB the sandboxes may write at least (the SDK sends ``minFreeDiskMb``; either spelling)."""


class TemplateBuildStartV2(_Body):
    from_image: str | None = Field(default=None, alias="fromImage", max_length=1024)
    from_template: str | None = Field(default=None, alias="fromTemplate", max_length=300)
    force: bool = False
    steps: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_STEPS)
    start_cmd: str | None = Field(default=None, alias="startCmd", max_length=64 << 10)
    ready_cmd: str | None = Field(default=None, alias="readyCmd", max_length=64 << 10)


class TemplateUpdateRequest(_Body):
    public: bool | None = None


class TagsRequest(_Body):
    target: str = Field(max_length=300)
    tags: list[str] = Field(min_length=1, max_length=64)


class RemoveTagsRequest(_Body):
    name: str = Field(max_length=300)
    tags: list[str] = Field(min_length=1, max_length=64)


LEVELS = ("debug", "info", "warn", "error")


def _ms(iso: str) -> int:
    """An entry's RFC 3339 timestamp as Unix milliseconds."""
    return int(datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def template_json(t: TemplateRecord) -> dict[str, Any]:
    """E2B's ``Template``."""
    last = t.latest_ready() or (t.builds[-1] if t.builds else Build(id=""))
    return {
        "templateID": t.id,
        "buildID": last.id,
        "cpuCount": last.cpu_count,
        "memoryMB": last.memory_mb,
        "diskSizeMB": last.disk_mb,
        "public": t.public,
        "aliases": [t.name],
        "names": [t.name],
        "createdAt": _iso(t.created_at),
        "updatedAt": _iso(t.updated_at),
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": t.spawn_count,
        "buildCount": len(t.builds),
        "envdVersion": ENVD_VERSION,
        "buildStatus": last.status,
    }


def build_json(b: Build) -> dict[str, Any]:
    """E2B's ``TemplateBuild``."""
    return {
        "buildID": b.id,
        "status": b.status,
        "createdAt": _iso(b.created_at),
        "updatedAt": _iso(b.updated_at),
        "cpuCount": b.cpu_count,
        "memoryMB": b.memory_mb,
        "diskSizeMB": b.disk_mb,
        "envdVersion": ENVD_VERSION,
        **({"finishedAt": _iso(b.finished_at)} if b.finished_at else {}),
    }


def make_template_api(templates: Templates, authenticated) -> tuple[APIRouter, APIRouter]:
    """``(routes needing the API key, the upload route)`` (see the module docstring)."""
    router = APIRouter(dependencies=[authenticated])
    uploads = APIRouter()

    def found(ref: str) -> TemplateRecord:
        t = templates.find(ref)
        if t is None:
            raise E2BError(404, f"template {ref!r} not found")
        return t

    @router.get("/templates/aliases/{alias}")
    def alias(alias: str) -> dict:
        if ":" not in alias:
            t = templates.find(alias)
            if t is not None:
                return {"templateID": t.id, "public": t.public}
            if store_template(alias):  # a template of the node's store (weenv build, import): a create starts it
                return {"templateID": alias, "public": True}
        raise E2BError(404, f"template alias {alias!r} not found")

    def store_template(name: str) -> bool:
        """Whether the node's store has a template ref ``name``: one made without
        E2B's build API (``weenv build``, ``weenv import``), as a node's ``base``
        is; every caller of the node may start it, hence public."""
        try:
            return templates.store.ref_or_none("templates", name) is not None
        except InvalidInputError:  # not a name a ref may have
            return False

    @router.get("/weenv/templates/{ref}")
    def resolve(ref: str) -> dict:
        t = found(ref)
        return {"templateID": t.id, "template": templates.resolve(ref)}  # NotFoundError (404): not ready

    @router.post("/v3/templates", status_code=202)
    def request_build(body: TemplateBuildRequestV3) -> dict:
        name = body.name or body.alias
        if not name:
            raise E2BError(400, "name: a template name is required")
        t, b, tags = templates.request(
            name, body.tags, cpu_count=body.cpu_count, memory_mb=body.memory_mb, min_free_disk_mb=body.min_free_disk_mb
        )
        return {
            "templateID": t.id,
            "buildID": b.id,
            "public": t.public,
            "names": [t.name],
            "tags": tags,
            "aliases": [t.name],
        }

    @router.get("/templates/{template_id}/files/{files_hash}", status_code=201)
    def file_link(request: Request, template_id: str, files_hash: str) -> dict:
        t = found(template_id)
        if len(files_hash) != 64 or any(c not in "0123456789abcdef" for c in files_hash):
            raise E2BError(400, f"hash {files_hash!r} is not 64 lowercase hex digits")
        templates.uploads.claim(t.id, files_hash)  # kept for this template's next build
        if templates.uploads.path(files_hash) is not None:
            return {"present": True}
        here = str(request.url.replace(query=""))
        url = f"{here[: here.rindex('/templates/')]}/templates/{t.id}/files/{files_hash}/upload"
        return {"present": False, "url": url, "headers": {UPLOAD_HEADER: templates.uploads.token(t.id, files_hash)}}

    @uploads.put("/templates/{template_id}/files/{files_hash}/upload", status_code=201)
    async def upload(
        request: Request,
        template_id: str,
        files_hash: str,
        token: Annotated[str | None, Header(alias=UPLOAD_HEADER)] = None,
        # the transport's own header, not a parameter of the API (its schema does not offer it)
        content_length: Annotated[int | None, Header(include_in_schema=False)] = None,
    ) -> Response:
        templates.uploads.check_token(token, template_id, files_hash)
        writer = await anyio.to_thread.run_sync(templates.uploads.writer, template_id, files_hash, content_length)
        try:
            async for chunk in request.stream():
                await anyio.to_thread.run_sync(writer.write, chunk)
            await anyio.to_thread.run_sync(writer.finish)
        finally:
            writer.abort()  # a no-op once finished
        return Response(status_code=201)

    @router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
    def start_build(template_id: str, build_id: str, body: TemplateBuildStartV2) -> Response:
        t = found(template_id)
        if (body.from_image is None) == (body.from_template is None) or not (body.from_image or body.from_template):
            raise E2BError(400, "exactly one of fromImage and fromTemplate must be given and non-empty")
        try:
            steps = [Step.model_validate(s) for s in body.steps]
        except ValidationError as exc:
            err = exc.errors()[0]
            raise E2BError(400, f"steps.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
        check_steps(steps)  # InvalidInputError (400): bad arguments, variables past their bounds
        spec = BuildSpec(
            steps=steps,
            from_image=body.from_image,
            from_template=body.from_template,
            force=body.force,
            start_command=body.start_cmd or None,
            ready_command=body.ready_cmd or None,
        )
        templates.start(t.id, build_id, spec)
        return Response(status_code=202)

    @router.get("/templates/{template_id}/builds/{build_id}/status")
    def status(
        template_id: str,
        build_id: str,
        logs_offset: Annotated[int, Query(alias="logsOffset", ge=0)] = 0,
        limit: Annotated[int, Query(ge=0, le=100)] = 100,
        level: Annotated[str | None, Query(pattern="^(debug|info|warn|error)$")] = None,
    ) -> dict:
        t = found(template_id)
        try:
            b = t.build(build_id)
        except NotFoundError as exc:
            raise E2BError(404, str(exc)) from None
        entries = templates.logs(build_id)
        if level is not None:
            entries = [e for e in entries if LEVELS.index(e["level"]) >= LEVELS.index(level)]
        out: dict[str, Any] = {
            "logs": [],
            "logEntries": entries[logs_offset : logs_offset + limit],
            "templateID": t.id,
            "buildID": b.id,
            "status": b.status,
        }
        if b.reason:
            out["reason"] = b.reason
        return out

    @router.get("/templates/{template_id}/builds/{build_id}/logs")
    def build_logs(
        template_id: str,
        build_id: str,
        cursor: Annotated[int | None, Query(ge=0)] = None,
        page_cursor: Annotated[str | None, Query(alias="pageCursor", max_length=512)] = None,
        limit: Annotated[int, Query(ge=0, le=100)] = 100,
        direction: Annotated[str, Query(pattern="^(forward|backward)$")] = "forward",
        level: Annotated[str | None, Query(pattern="^(debug|info|warn|error)$")] = None,
        source: Annotated[str | None, Query(pattern="^(temporary|persistent)$")] = None,
    ) -> dict:
        """E2B's build logs: ``cursor`` the first timestamp (ms) wanted (``backward``:
        the last), ``pageCursor`` the ``nextCursor`` of the page before; each entry's
        ``id`` is its place in the log.  weenv keeps build logs in memory only, so
        either ``source`` answers the same entries, as ``temporary``."""
        t = found(template_id)
        try:
            t.build(build_id)
        except NotFoundError as exc:
            raise E2BError(404, str(exc)) from None
        entries = [{"id": str(i), **e} for i, e in enumerate(templates.logs(build_id))]
        if level is not None:
            entries = [e for e in entries if LEVELS.index(e["level"]) >= LEVELS.index(level)]
        if cursor is not None:
            entries = [
                e
                for e in entries
                if (_ms(e["timestamp"]) >= cursor if direction == "forward" else _ms(e["timestamp"]) <= cursor)
            ]
        if direction == "backward":
            entries.reverse()
        start = 0
        if page_cursor is not None:
            if not page_cursor.isdigit():
                raise E2BError(400, f"bad pageCursor {page_cursor[:64]!r}: pass the nextCursor of the page before")
            start = int(page_cursor)
        out: dict[str, Any] = {"logs": entries[start : start + limit], "source": "temporary"}
        if start + limit < len(entries):
            out["nextCursor"] = str(start + limit)
        return out

    @router.get("/templates")
    def list_templates() -> list[dict]:
        return [template_json(t) for t in templates.list()]

    @router.get("/v2/templates")
    def list_templates_v2(
        response: Response,
        limit: Annotated[int, Query(ge=1, le=100)] = 100,
        next_token: Annotated[str | None, Query(alias="nextToken", max_length=64)] = None,
    ) -> list[dict]:
        """Oldest first, ``limit`` a page; ``X-Next-Token`` names the next page."""
        found_ = templates.list()
        start = page_start(next_token)
        token = next_token_of(start, limit, len(found_))
        if token is not None:
            response.headers["X-Next-Token"] = token
        return [template_json(t) for t in found_[start : start + limit]]

    @router.patch("/templates/{template_id}")
    def update_v1(template_id: str, body: TemplateUpdateRequest) -> Response:
        t = found(template_id)
        if body.public is not None:
            templates.set_public(t.id, body.public)
        return Response(status_code=200)

    @router.patch("/v2/templates/{template_id}")
    def update_v2(template_id: str, body: TemplateUpdateRequest) -> dict:
        t = found(template_id)
        if body.public is not None:
            t = templates.set_public(t.id, body.public)
        return {"names": [t.name]}

    @router.get("/templates/{template_id}")
    def get_template(template_id: str) -> dict:
        t = found(template_id)
        return {**template_json(t), "builds": [build_json(b) for b in reversed(t.builds)]}

    @router.post("/templates/tags", status_code=201)
    def assign(body: TagsRequest) -> dict:
        build_id, tags_ = templates.assign_tags(body.target, body.tags)
        return {"buildID": build_id, "tags": tags_}

    @router.delete("/templates/tags", status_code=204)
    def remove(body: RemoveTagsRequest) -> Response:
        templates.remove_tags(body.name, body.tags)
        return Response(status_code=204)

    @router.delete("/templates/{template_id}", status_code=204)
    async def delete(template_id: str) -> Response:
        """A template built here (its build cancelled and undone), else a
        snapshot (E2B deletes snapshots as templates; 404 when it is neither)."""
        if templates.find(template_id) is None:
            await anyio.to_thread.run_sync(templates.node.delete_snapshot, template_id)
        else:
            await anyio.to_thread.run_sync(templates.delete, template_id)
        return Response(status_code=204)

    @router.get("/templates/{template_id}/tags")
    def tags(template_id: str) -> list[dict]:
        t = found(template_id)
        return [{"tag": tag, "buildID": v["build"], "createdAt": _iso(v["at"])} for tag, v in t.tags.items()]

    return router, uploads
