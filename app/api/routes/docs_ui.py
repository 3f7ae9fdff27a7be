"""`/docs`: Swagger UI served from this server's own files (no CDN).

FastAPI's default page loads its script and style from a CDN, which fails
offline and lets a third party run script next to the API. The assets come
from the `swagger-ui-bundle` package and are served under `/docs/`; ReDoc
(CDN only) is off.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

from app.api.problems import JSONText
from app.domain.errors import InvalidRequest

router = APIRouter(include_in_schema=False, default_response_class=JSONText)
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
ASSET_PATHS = frozenset(f"/docs/{name}" for name in ASSETS)


@router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title="turnlog - Swagger UI",
        swagger_js_url="/docs/swagger-ui-bundle.js", swagger_css_url="/docs/swagger-ui.css",
        swagger_favicon_url="/docs/favicon-32x32.png",
        oauth2_redirect_url="/docs/oauth2-redirect")


@router.get("/docs/oauth2-redirect")
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/docs/{name}")
async def swagger_asset(name: str) -> FileResponse:
    if name not in ASSETS:  # a fixed list: no path from the URL reaches the file system
        raise InvalidRequest("no such documentation asset", field="name",
                             expected=sorted(ASSETS), actual=name[:80], status=404)
    return FileResponse(Path(str(swagger_ui_path)) / name, media_type=ASSETS[name],
                        headers={"Cache-Control": "public, max-age=86400"})
