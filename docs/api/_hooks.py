"""MkDocs hooks (``hooks:`` in mkdocs.yml), run when the site is built.

* Figures: benchmarks.md holds the marker ``<!-- figures -->``, replaced by one image per
  ``docs/figures/*.png`` that exists (in file-name order), or by a note when there is none.
* Repository files: a relative link from a page to a file of the repository outside ``docs/``
  (``../examples/digits.py``, ``../scripts/slurm/bench_comm.sbatch``) is pointed at a copy of that
  file published under ``source/`` in the site, so it works there and the strict build does not
  report it. Links to anything that does not exist are left alone and reported as usual.
"""

from __future__ import annotations

import os
import posixpath
import re

from mkdocs.structure.files import File

MARKER = "<!-- figures -->"
FIGURES_PAGE = "benchmarks.md"
FIGURES = "figures/"
PUBLISHED = "source/"
# an inline link or image target: ](target) or ](target#anchor), no scheme, no absolute path
_LINK = re.compile(r"\]\((?![a-zA-Z][a-zA-Z0-9+.-]*:|/|#)([^)\s#]+)(#[^)\s]*)?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _title(src_uri: str) -> str:
    stem = posixpath.splitext(posixpath.basename(src_uri))[0]
    return stem.replace("_", " ").replace("-", " ")


def _figures(markdown: str, files) -> str:
    figures = sorted(f.src_uri for f in files
                     if f.src_uri.startswith(FIGURES) and f.src_uri.endswith(".png"))
    if not figures:
        block = ('!!! note "No figures in this build"\n'
                 "    `docs/figures/` holds no PNG files. Run the benchmarks with `--plot "
                 "docs/figures` and build the site again.\n")
    else:
        block = "\n\n".join(f"### {_title(uri)}\n\n![{_title(uri)}]({uri})" for uri in figures)
    return markdown.replace(MARKER, block)


def _repository_links(markdown: str, page, config, files) -> str:
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    docs = os.path.relpath(os.path.abspath(config.docs_dir), root).replace(os.sep, "/")
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        in_repo = posixpath.normpath(posixpath.join(docs, page_dir, target))
        if in_repo.startswith("../") or in_repo == docs or in_repo.startswith(docs + "/"):
            return match.group(0)  # a page of the site, or outside the repository
        path = os.path.join(root, *in_repo.split("/"))
        if not os.path.isfile(path):
            return match.group(0)
        src_uri = PUBLISHED + in_repo
        if files.get_file_from_path(src_uri) is None:
            files.append(File.generated(config, src_uri, abs_src_path=path))
        return f"]({posixpath.relpath(src_uri, page_dir or '.')}{anchor})"

    lines, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        lines.append(line if fenced else _LINK.sub(rewrite, line))
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == FIGURES_PAGE and MARKER in markdown:
        markdown = _figures(markdown, files)
    return _repository_links(markdown, page, config, files)
