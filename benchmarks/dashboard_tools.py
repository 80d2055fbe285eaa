"""Steps of ``check_dashboard.sh`` (asv imports this module too and finds no benchmarks).

    python dashboard_tools.py layout SRC               package links for an exported tree
    python dashboard_tools.py config REPO SRC OUT      a scratch asv config, on stdout
    python dashboard_tools.py commits HTML METRIC      the metric's graph spans >= 2 commits
    python dashboard_tools.py vendor HTML NPM_CACHE    serve asv's CDN libraries locally
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

# File name in asv's CDN URLs -> (npm package, file in it). stupid-table-plugin is on npm
# only as 1.1.3 (same API as the CDN's 1.0.1).
LIBRARIES = {
    "jquery-3.3.1.min.js": ("jquery@3.3.1", "dist/jquery.min.js"),
    "jquery.flot.min.js": ("flot@0.8.3", "jquery.flot.js"),
    "jquery.flot.time.min.js": ("flot@0.8.3", "jquery.flot.time.js"),
    "jquery.flot.selection.min.js": ("flot@0.8.3", "jquery.flot.selection.js"),
    "jquery.flot.categories.min.js": ("flot@0.8.3", "jquery.flot.categories.js"),
    "jquery.flot.orderBars.js": ("flot-orderbars@1.0.0", "js/jquery.flot.orderBars.js"),
    "stupidtable.min.js": ("stupid-table-plugin@1.1.3", "stupidtable.min.js"),
    "md5.min.js": ("blueimp-md5@2.19.0", "js/md5.min.js"),
    "bootstrap.min.js": ("bootstrap@3.1.1", "dist/js/bootstrap.min.js"),
    "bootstrap.min.css": ("bootstrap@3.1.1", "dist/css/bootstrap.min.css"),
}
_CDN_TAG = re.compile(r"""<(?:script|link)\b[^>]*?(?:src|href)="(https?://[^"]+)"[^>]*>""")


def layout(src: Path) -> None:
    """Links that give an exported tree pyproject's package-dir layout, so that it imports
    as ``kvbench`` without being installed."""
    pyproject = tomllib.loads((src / "pyproject.toml").read_text(encoding="utf-8"))
    for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        target = src / Path(*name.split("."))
        if target != src / folder and not target.exists():
            target.symlink_to((src / folder).resolve(), target_is_directory=True)


def config(repo: str, src: str, out: str) -> None:
    print(json.dumps({
        "version": 1, "project": "kvbench", "repo": repo, "branches": ["HEAD"],
        "environment_type": "existing", "pythons": [sys.executable],
        "benchmark_dir": f"{src}/benchmarks", "results_dir": f"{out}/results",
        "html_dir": f"{out}/html",
    }, indent=1))


def commits(html: Path, metric: str) -> None:
    graphs = sorted(html.glob(f"graphs/**/branch-*/**/{metric}.json"))
    if not graphs:
        sys.exit(f"FAIL: no graph for {metric} under {html}/graphs")
    # One point per commit: [revision, value], or a value per parameter combination.
    points = json.loads(graphs[0].read_text(encoding="utf-8"))
    measured = [p for p in points
                if any(v is not None for v in (p[1] if isinstance(p[1], list) else [p[1]]))]
    print(f"{metric}: results for {len(measured)} commits in {graphs[0].relative_to(html)}")
    if len(measured) < 2:
        sys.exit(f"FAIL: {metric} has results for {len(measured)} commit(s), need 2")


def vendor(html: Path, npm_cache: Path) -> None:
    """Point asv's page at local copies of its CDN libraries, taken from npm packages."""
    page = (html / "index.html").read_text(encoding="utf-8")
    (html / "vendor").mkdir(exist_ok=True)
    npm_cache.mkdir(parents=True, exist_ok=True)
    urls = _CDN_TAG.findall(page)
    for url in urls:
        name = url.rsplit("/", 1)[1]
        if name not in LIBRARIES:
            sys.exit(f"FAIL: asv's page loads {url}; add it to LIBRARIES in {__file__}")
        package, member = LIBRARIES[name]
        tgz = npm_cache / (package.replace("@", "-") + ".tgz")
        if not tgz.exists():
            subprocess.run(["npm", "pack", "--silent", "--pack-destination", str(npm_cache),
                            package], check=True, stdout=subprocess.DEVNULL)
        with tarfile.open(tgz) as tar:
            member_file = tar.extractfile(f"package/{member}")
            assert member_file is not None
            (html / "vendor" / name).write_bytes(member_file.read())
        page = page.replace(url, f"vendor/{name}")
    # The local copies are not byte-identical to the CDN's files: drop integrity checks.
    page = re.sub(r'\s(?:integrity|crossorigin|referrerpolicy)="[^"]*"', "", page)
    (html / "index.html").write_text(page, encoding="utf-8")
    print(f"{len(urls)} libraries served from {html / 'vendor'}")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "layout":
        layout(Path(args[0]))
    elif command == "config":
        config(*args)
    elif command == "commits":
        commits(Path(args[0]), args[1])
    elif command == "vendor":
        vendor(Path(args[0]), Path(args[1]))
    else:
        sys.exit(__doc__)
