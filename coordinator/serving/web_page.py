"""The web page at / : a chat and the live cluster view, from the files in
coordinator/serving/web/ (package data). No build step and nothing fetched
from anywhere else; its Content-Security-Policy tells the browser so too.
The page and its assets are open even with --api-key (they hold no secret):
the page asks for the key and sends it on every API call."""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).with_name("web")
ASSETS = {"/web/app.js": ("app.js", "text/javascript"), "/web/style.css": ("style.css", "text/css")}
PATHS = ("/", *ASSETS)  # served without the API key
HEADERS = {
    # only this server, nothing else: no CDN, font, analytics or other origin, even by mistake
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_routes(app: web.Application, auth_required: bool) -> None:
    """GET / and the assets, read once now."""
    page = (WEB_DIR / "index.html").read_text("utf-8").replace("{{AUTH_REQUIRED}}", str(auth_required).lower())
    bodies = {"/": (page.encode(), "text/html")}
    bodies.update({path: ((WEB_DIR / name).read_bytes(), kind) for path, (name, kind) in ASSETS.items()})

    def serve(body: bytes, kind: str):
        async def handler(request) -> web.Response:
            return web.Response(body=body, content_type=kind, charset="utf-8", headers=HEADERS)
        return handler

    for path, (body, kind) in bodies.items():
        app.router.add_get(path, serve(body, kind))
