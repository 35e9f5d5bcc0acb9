"""The web playground at `GET /`: three static files shipped inside the package (`glm5/serve/static/`).

Read through `importlib.resources`, so a wheel install serves them too; no build step, no CDN (the page
works offline). The page talks to the server only through the public API routes (chat, infill, models,
OCR when `--ocr` is on, `/metrics`), with the API key the user types, so it needs no route of its own
beyond these files. Only the files named in `ASSETS` are served: no path from the URL reaches the disk.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from glm5.serve.common import APIError

PAGE = "index.html"
# file under /static/ -> its Content-Type
ASSETS = {"playground.js": "text/javascript; charset=utf-8", "playground.css": "text/css; charset=utf-8"}


@cache
def read_asset(name: str) -> bytes:
    """The packaged file `glm5/serve/static/<name>` (read once per process)."""
    return resources.files("glm5.serve").joinpath("static", name).read_bytes()


def install(app: FastAPI) -> None:
    """Add `GET /` (the page) and `GET /static/{name}` (its script and style sheet) to `app`."""

    @app.get("/", include_in_schema=False)
    async def page():
        return Response(read_asset(PAGE), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in ASSETS:
            raise APIError(404, f"no static file {name!r}; the playground has {sorted(ASSETS)}",
                           "not_found_error", param="name")
        return Response(read_asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})
