"""GET /keyboard: the predictive keyboard page, static HTML, JS and CSS from `server/static/keyboard/`.

The page is a client of the public API like any other (fetch to the same origin, the API key it is given), so
nothing here touches the engine or needs a key; it is left out of the API's schema.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from server.errors import NotFoundError

__all__ = ["STATIC_DIR", "router"]

STATIC_DIR = Path(__file__).resolve().parent.parent / "static" / "keyboard"
# The page's assets, by name: nothing else under the directory is served.
_ASSETS = {"keyboard.js": "text/javascript; charset=utf-8", "keyboard.css": "text/css; charset=utf-8"}
# The page is small and changes with the server: browsers revalidate it (ETag) rather than keep an old copy. It runs
# only its own script and talks only to this origin (CSP), is never framed by another site (it holds an API key:
# clickjacking), and sends no Referer (its address may carry ?key=).
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(include_in_schema=False)


@router.get("/keyboard", response_class=FileResponse)
async def keyboard_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.get("/keyboard/{asset}", response_class=FileResponse)
async def keyboard_asset(asset: str) -> FileResponse:
    media_type = _ASSETS.get(asset)
    if media_type is None:
        raise NotFoundError(f"no keyboard asset {asset!r}", param="asset")
    return FileResponse(STATIC_DIR / asset, media_type=media_type, headers=_HEADERS)
