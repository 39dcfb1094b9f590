"""The API's parameters, read as it defines them: form fields, expiry, metadata, pages. Each
refusal an ApiError."""

from __future__ import annotations

from typing import Any

from aiohttp import BodyPartReader, web

from .apierror import ApiError

FIELD_BYTES = 1024
"""A form field's value at most (the file apart): read no further."""


async def read_field(part: BodyPartReader) -> str:
    """A small form field's text; one longer than FIELD_BYTES is refused unread."""
    value = bytearray()
    while chunk := await part.read_chunk(FIELD_BYTES):
        value += chunk
        if len(value) > FIELD_BYTES:
            raise ApiError(
                400,
                f"The form field {part.name!r} is longer than {FIELD_BYTES} bytes.",
                param=part.name,
                code="invalid_value",
            )
    try:
        return value.decode().strip()
    except UnicodeDecodeError:
        raise ApiError(
            400, f"The form field {part.name!r} is not UTF-8 text.", param=part.name
        ) from None


def not_json(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def expires_after(given: dict[str, Any], *, default: Any) -> Any:
    """Seconds a file is kept, from the API's `expires_after` ({anchor: created_at, seconds:
    3600 to 2592000}); `default` when not given."""
    if not given:
        return default
    anchor, seconds = given.get("anchor"), given.get("seconds")
    if anchor != "created_at":
        raise ApiError(
            400,
            f"Invalid value for 'expires_after.anchor': {anchor!r}. Supported: 'created_at'.",
            param="expires_after.anchor",
            code="invalid_value",
        )
    try:
        value = int(str(seconds))
    except ValueError:
        value = 0
    if not 3600 <= value <= 2_592_000:
        raise ApiError(
            400,
            f"Invalid value for 'expires_after.seconds': {seconds!r}: 3600 to 2592000.",
            param="expires_after.seconds",
            code="invalid_value",
        )
    return value


def metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(
            400,
            "Invalid type for 'metadata': expected an object.",
            param="metadata",
            code="invalid_type",
        )
    if len(value) > 16:
        raise ApiError(
            400, "'metadata' holds at most 16 pairs.", param="metadata", code="invalid_value"
        )
    for k, v in value.items():
        if not isinstance(v, str):
            raise ApiError(
                400,
                f"Invalid type for 'metadata.{k}': expected a string.",
                param=f"metadata.{k}",
                code="invalid_type",
            )
        if len(k) > 64 or len(v) > 512:
            raise ApiError(
                400,
                f"'metadata.{k}': keys hold at most 64 characters, values 512.",
                param=f"metadata.{k}",
                code="invalid_value",
            )
    return dict(value)


def page(
    request: web.Request, items: list[Any], *, default: int, most: int, order: str | None = None
) -> tuple[list[Any], bool]:
    """One page of `items` (ids sort by creation): `order` (newest first unless `asc`),
    after the id `after`, at most `limit`."""
    try:
        limit = int(request.query.get("limit", default))
    except ValueError:
        raise ApiError(
            400, "'limit' must be a whole number.", param="limit", code="invalid_type"
        ) from None
    if not 1 <= limit <= most:
        raise ApiError(
            400, f"'limit' must lie in [1, {most}].", param="limit", code="invalid_value"
        )
    order = order or request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "'order' is asc or desc.", param="order", code="invalid_value")
    ordered = sorted(items, key=lambda i: i.id, reverse=order == "desc")
    after = request.query.get("after")
    if after:
        ordered = [i for i in ordered if (i.id < after if order == "desc" else i.id > after)]
    return ordered[:limit], len(ordered) > limit


def listing(data: list[dict[str, Any]], more: bool) -> web.Response:
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )
