"""The web playground's files and the routes its script calls (fast: a scripted engine, no browser).

`GET /` and `/static/*` serve the packaged files with their content types and need no key; every route
the script reaches (its `ROUTES` table, the only way it calls `fetch`) exists on the app with that method;
every element id the script looks up is in the page; a wheel built from the tree serves them from where
it is unpacked (importlib.resources, not repository paths; .ci/wheel_smoke also fetches them from a
wheel install's `glm5 serve`).
The page in a real browser against a real server: tests/test_playground_browser.py.
"""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from tests.test_serve_app import FakeEngine

ROOT = Path(__file__).resolve().parents[1]
STATIC = resources.files("glm5.serve").joinpath("static")
JS = STATIC.joinpath("playground.js").read_text()
HTML = STATIC.joinpath("index.html").read_text()


def js_routes() -> dict[str, tuple[str, str]]:
    """The script's ROUTES table: name -> (method, path)."""
    table = re.search(r"const ROUTES = \{(.*?)\};", JS, re.S).group(1)
    routes = {name: (method, path) for name, method, path in re.findall(r'(\w+): "(GET|POST) (/[^"]*)"', table)}
    assert len(routes) == table.count(":"), f"an entry of ROUTES is not 'name: \"METHOD /path\"': {table}"
    return routes


@pytest.fixture(scope="module")
def app():
    from glm5.apps.ocr import server as ocr_server
    from glm5.apps.ocr.agent import OcrAgent, OcrConfig
    app = create_app(FakeEngine(), model_name="tiny", config=ServerConfig(api_key="k"))
    ocr_server.install(app, OcrAgent(OcrConfig(rounds=0, num_threads=1)))  # as `glm5 serve --ocr` does
    return app


def test_page_and_assets_are_served_with_their_types_and_no_key(app):
    http = TestClient(app)
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.content == STATIC.joinpath("index.html").read_bytes()
    linked = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert sorted(linked) == ["/static/playground.css", "/static/playground.js"]
    want = {"/static/playground.js": "text/javascript", "/static/playground.css": "text/css"}
    for path in linked:
        r = http.get(path)
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] == want[path]
        assert r.content == STATIC.joinpath(path.rsplit("/", 1)[1]).read_bytes()
    assert http.get("/v1/models").status_code == 401  # the API keeps its key; the page asks for it


@pytest.mark.parametrize("path", ["/static/index.html.bak", "/static/..%2Fapp.py", "/static/", "/static/x/y.js",
                                  "/index.html"])
def test_only_the_named_files_are_served(app, path):
    r = TestClient(app).get(path)
    assert r.status_code == 404 and "error" in r.json()


def test_every_route_the_script_calls_exists_on_the_app(app):
    routes = js_routes()
    assert JS.count("fetch(") == 1 and "fetch(path, {method, headers, body: payload, signal})" in JS
    called = set(re.findall(r'\bapi\("(\w+)"', JS))
    assert called == set(routes), f"ROUTES used {sorted(called)} vs declared {sorted(routes)}"
    served = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ())}
    for name, (method, path) in routes.items():
        assert (method, path) in served, f"the playground calls {method} {path} ({name}); the app has no such route"
    # what the page promises: chat, infill, models, OCR and metrics all reached through the public API
    assert {p for _, p in routes.values()} == {"/v1/chat/completions", "/infill", "/v1/models", "/v1/ocr", "/metrics"}


def test_every_element_the_script_looks_up_is_in_the_page():
    ids = set(re.findall(r'\bid="([\w-]+)"', HTML))
    used = set(re.findall(r'\$\("([\w-]+)"\)', JS))
    assert used and used <= ids, f"missing in index.html: {sorted(used - ids)}"
    tabs = set(re.findall(r'data-tab="(\w+)"', HTML))
    panels = set(re.findall(r'<section id="(\w+)" class="panel', HTML))
    assert tabs == panels == {"chat", "infill", "ocr", "metrics"}


def test_page_loads_nothing_from_elsewhere():
    for text in (HTML, JS, STATIC.joinpath("playground.css").read_text()):
        assert not re.search(r"https?://", text), "the playground must work offline (no CDN)"
        assert "@import" not in text and "url(" not in text


def test_package_data_covers_the_static_files():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["glm5"]
    files = [p.relative_to(ROOT / "glm5").as_posix() for p in (ROOT / "glm5/serve/static").iterdir()]
    assert sorted(files) == ["serve/static/index.html", "serve/static/playground.css", "serve/static/playground.js"]
    for f in files:
        assert any(fnmatch(f, g) for g in globs), f"{f} is not package data: a wheel would lack it"


# Run from the unpacked wheel, outside the repository: the playground's routes on a bare FastAPI app.
FROM_WHEEL = """
import glm5, sys
from fastapi import FastAPI
from fastapi.testclient import TestClient
from glm5.serve import playground
assert glm5.__file__.startswith(sys.argv[1]), glm5.__file__
app = FastAPI()
playground.install(app)
http = TestClient(app)
for path in ("/", "/static/playground.js", "/static/playground.css"):
    r = http.get(path)
    print(path, r.status_code, r.headers["content-type"], len(r.content), sep="\\t")
"""


def test_a_wheel_install_serves_the_playground(tmp_path):
    """Build a wheel from the tracked files (as .ci/wheel_smoke copies them), unpack it, serve from there."""
    if shutil.which("git") is None:
        pytest.skip("needs git to list the tracked files")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    src = tmp_path / "src"
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path, capture_output=True)
    site = tmp_path / "site"
    with zipfile.ZipFile(next((tmp_path / "dist").glob("glm5-*.whl"))) as z:
        z.extractall(site)
    out = subprocess.run([sys.executable, "-c", FROM_WHEEL, str(site)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    assert [(p, code, ctype.split(";")[0]) for p, code, ctype, _ in rows] == [
        ("/", "200", "text/html"), ("/static/playground.js", "200", "text/javascript"),
        ("/static/playground.css", "200", "text/css")]
    assert [int(n) for *_, n in rows] == [len(STATIC.joinpath(n).read_bytes())
                                          for n in ("index.html", "playground.js", "playground.css")]
