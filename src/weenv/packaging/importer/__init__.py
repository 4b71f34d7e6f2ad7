"""Importing existing container images (OCI layout, ``docker save`` archive,
registry via skopeo) as layer groups and a template: :func:`import_image`."""

from weenv.packaging.importer.image_import import (
    ImportResult,
    default_name,
    import_image,
    plan_groups,
)

__all__ = ["ImportResult", "default_name", "import_image", "plan_groups"]
