"""The OCR agent on `glm5 serve --ocr`: `POST /v1/ocr` and `image_url` parts in chat messages.

`POST /v1/ocr` takes either a multipart upload (field `file`, optional fields `format`, `rounds`) or
a JSON body `{"image": "<base64 or data: URL>", "format": "json"|"md"|"txt", "rounds": N}` and
answers `{"object": "ocr.page", "format", "text", "page"}` (`page` = the JSON result, always). In
chat, every `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}` part becomes
a text part holding the page's Markdown, so the model answers with the OCR text in its prompt.

Errors follow the server's OpenAI error format: an unreadable image is a 400 naming the problem; a
page whose estimated recognition work exceeds `OcrConfig.max_work_mpx` is a 413 (code
`ocr_work_limit`) before any line is read; a page not read within `OcrConfig.timeout_s` is a 504
(code `ocr_timeout`), and its worker thread stops at the next check (glm5/apps/ocr/limits.py).
OCR runs in a worker thread; the event loop keeps serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from glm5.apps.ocr.agent import OcrAgent
from glm5.apps.ocr.image import ImageError, decode_base64, decode_data_url
from glm5.apps.ocr.limits import OcrOverBudget, OcrTimeout
from glm5.apps.ocr.render import PageResult, to_json, to_markdown, to_text
from glm5.serve.common import APIError

MAX_ROUNDS = 8


class OcrRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(min_length=1)
    format: Literal["json", "md", "txt"] = "md"
    rounds: int | None = Field(default=None, ge=0, le=MAX_ROUNDS)
    name: str = Field(default="image", max_length=256)


def render(res: PageResult, fmt: str) -> dict:
    text = {"md": to_markdown, "txt": to_text, "json": lambda r: json.dumps(to_json(r), ensure_ascii=False)}[fmt](res)
    return {"object": "ocr.page", "format": fmt, "text": text, "page": to_json(res)}


def image_part_text(agent: OcrAgent, url: str) -> str:
    """An `image_url` URL -> the text that replaces the part in the prompt (raises ImageError; an
    `APIError` 413 / 504 past the agent's work budget or deadline, which starts here, per image)."""
    deadline = agent.deadline()
    try:
        res = agent.read_bytes(decode_data_url(url), "image_url", deadline=deadline)
    except (OcrOverBudget, OcrTimeout) as e:
        raise limit_error(e, "messages") from e
    body = to_markdown(res).strip()
    return f"[image: OCR text]\n{body}\n[end of image]" if body else "[image: no text found]"


def limit_error(e: OcrOverBudget | OcrTimeout, param: str) -> APIError:
    """The API error for a page past the agent's limits, with the server flag that raises each."""
    if isinstance(e, OcrOverBudget):
        return APIError(413, f"{e} (server limit: glm5 serve --ocr-max-work-mpx)", param=param,
                        code="ocr_work_limit")
    return APIError(504, f"{e} (server limit: glm5 serve --ocr-timeout-s); send a smaller page or fewer rounds",
                    type_="timeout_error", param=param, code="ocr_timeout")


def install(app: FastAPI, agent: OcrAgent) -> None:
    """Add `POST /v1/ocr` to a `glm5.serve.app.create_app` application."""

    @app.post("/v1/ocr")
    async def ocr(request: Request):
        deadline = agent.deadline()  # from the request's arrival: reading the upload counts too
        req = await _parse(request)
        try:
            data = _image_bytes(req.image)
            res = await asyncio.to_thread(agent.read_bytes, data, req.name, req.rounds, deadline)
        except ImageError as e:
            raise APIError(400, str(e), param="image", code="invalid_image") from e
        except (OcrOverBudget, OcrTimeout) as e:
            raise limit_error(e, "image") from e
        return render(res, req.format)


def _image_bytes(image: bytes | str) -> bytes:
    if isinstance(image, bytes):
        return image
    return decode_data_url(image, "image") if image.startswith("data:") else decode_base64(image, "image")


class _Upload(BaseModel):
    """A parsed request whatever its encoding: raw image bytes or base64 text."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    image: bytes | str
    format: Literal["json", "md", "txt"] = "md"
    rounds: int | None = Field(default=None, ge=0, le=MAX_ROUNDS)
    name: str = "image"


async def _parse(request: Request) -> _Upload:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if ctype == "multipart/form-data":
            return await _parse_form(request)
        if ctype in ("application/json", ""):
            body = await request.body()
            try:
                data = json.loads(body or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"Malformed JSON body: {e}", param="body") from e
            if not isinstance(data, dict):
                raise APIError(400, "body: expected a JSON object with an `image` field", param="body")
            r = OcrRequest.model_validate(data)
            return _Upload(image=r.image, format=r.format, rounds=r.rounds, name=r.name)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err.get("loc", ())) or "body"
        raise APIError(400, f"{field}: {err.get('msg')}", param=field) from e
    raise APIError(415, f"unsupported Content-Type {ctype!r}: send multipart/form-data (field `file`) "
                        "or application/json ({\"image\": base64})", param="content-type",
                   code="unsupported_media_type")


async def _parse_form(request: Request) -> _Upload:
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as e:  # noqa: BLE001 - malformed multipart bodies raise several parser errors
        raise APIError(400, f"malformed multipart body: {e}", param="file") from e
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise APIError(400, "file: multipart field `file` with the image is required", param="file")
    data = await upload.read()
    fields = {k: v for k, v in form.items() if k in ("format", "rounds") and isinstance(v, str)}
    unknown = sorted(set(form.keys()) - {"file", "format", "rounds"})
    if unknown:
        raise APIError(400, f"unknown form field(s) {unknown}; expected file, format, rounds", param=unknown[0])
    return _Upload.model_validate({"image": data, "name": upload.filename or "upload", **fields})
