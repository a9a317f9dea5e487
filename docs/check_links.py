"""The link check of the built docs site: every internal link of every page of `site/`
(href and src) must name a file that exists, and its `#anchor` an id on that page.

    python docs/check_links.py [SITE_DIR]

Prints each broken link as `page: link (why)` and exits 1 if there is any; external links
(http:, https:, mailto:, ...) are not fetched: the check needs no network.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name") and (name == "id" or tag == "a"):
                self.ids.add(value)
            elif (name == "href" and tag in ("a", "link")) or (name == "src" and tag != "iframe"):
                self.links.append(value)


def _parse(path: Path, cache: dict[Path, _Page]) -> _Page:
    if path not in cache:
        page = _Page()
        page.feed(path.read_text(encoding="utf-8", errors="replace"))
        cache[path] = page
    return cache[path]


def _target(site: Path, page: Path, path: str) -> Path | None:
    """The file a link's path names, or None when it names nothing in the site."""
    base = site if path.startswith("/") else page.parent
    target = (base / unquote(path.lstrip("/"))).resolve()
    if target.is_dir():
        target = target / "index.html"
    if not target.is_file():
        return None
    return target


def broken_links(site: Path) -> list[str]:
    """Every broken internal link of the HTML pages under `site`, as `page: link (why)`."""
    site = site.resolve()
    cache: dict[Path, _Page] = {}
    problems = []
    for page_path in sorted(site.rglob("*.html")):
        page = _parse(page_path, cache)
        where = page_path.relative_to(site)
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("data:", "javascript:")):
                continue
            target = _target(site, page_path, parts.path) if parts.path else page_path
            if target is None:
                problems.append(f"{where}: {link} (no such file)")
                continue
            anchor = unquote(parts.fragment)
            if anchor and target.suffix == ".html" and anchor not in _parse(target, cache).ids:
                problems.append(f"{where}: {link} (no anchor #{anchor} in {target.name})")
    return problems


def main(argv: list[str]) -> int:
    site = Path(argv[1] if len(argv) > 1 else "site")
    if not (site / "index.html").is_file():
        print(f"check_links: no built site at {site}/ (run `make docs` first)", file=sys.stderr)
        return 2
    problems = broken_links(site)
    for problem in problems:
        print(problem)
    pages = sum(1 for _ in site.rglob("*.html"))
    print(f"check_links: {pages} pages, {len(problems)} broken links", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
