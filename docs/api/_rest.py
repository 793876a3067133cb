"""Griffe extension for the API pages (``extensions:`` of the mkdocstrings handler in mkdocs.yml).

heatlike's docstrings are prose in reStructuredText habits, and mkdocstrings renders them as
Markdown. These habits would show up as markup, so they are rewritten when the docstrings are
loaded (the sources are not touched):

* cross-reference roles: ``:class:`Topology```, ``:func:`~heatlike.engine.buckets.pack```
  become code spans (`` `Topology` ``, `` `pack` ``: a leading ``~`` keeps the last component);
* simple tables (columns under rows of ``=====  =====``) become Markdown tables; a line continues
  the row above it when its first column is blank, when only its first column has text, or when
  the row above leaves a double-backtick span or a parenthesis open;
* a section title underlined with dashes (``Parameters`` / ``----------``) becomes a bold line
  instead of a page heading, and its ``name: description`` items (indented lines continue an
  item) become a list;
* an aligned term list (lines that start with a double-backtick term followed by two or more
  spaces and its description, indented lines continuing it) becomes a list;
* a definition (a paragraph's first line alone, its text indented below it) becomes a run-in
  bold term followed by the text;
* an asterisk between two word characters (``P*b``) is a product, not emphasis: it is escaped.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
_BORDER = re.compile(r"^=+(?: +=+)+\s*$")
_CODE = re.compile(r"(`+)(.+?)\1")
_PRODUCT = re.compile(r"(?<=[\w)])\*(?=[\w(])")
_UNDERLINE = re.compile(r"^-{3,}\s*$")
_TERM = re.compile(r"^(``[^`]+``)\s{2,}(\S.*)$")
_NEXT_TERM = re.compile(r"^(``[^`]+``)\s+(\S.*)$")  # inside a list one space is enough
_ITEM = re.compile(r"^([A-Za-z_*][\w*]*(?:\s*,\s*[A-Za-z_*][\w*]*)*)\s*:\s+(.*)$")


def _role(match: re.Match) -> str:
    short, target = match.group(1), match.group(2).strip()
    if short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _escape_pipes(text: str) -> str:
    """``|`` outside code spans would split a Markdown table cell."""
    return _outside_code(text, lambda t: t.replace("|", r"\|"))


def _cells(line: str, starts: list[int]) -> list[str]:
    """The line cut at the column starts. A word that runs over a start stays whole: with the
    column on its left when a single space precedes it, else it starts the column."""
    cuts = [0]
    for start in starts[1:]:
        cut = max(start, cuts[-1])
        if 0 < cut < len(line) and not line[cut - 1].isspace() and not line[cut].isspace():
            word = cut
            while word > cuts[-1] and not line[word - 1].isspace():
                word -= 1
            if word - 2 >= cuts[-1] and line[word - 2:word] == "  ":
                cut = word
            else:
                while cut < len(line) and not line[cut].isspace():
                    cut += 1
        cuts.append(cut)
    cuts.append(len(line))
    return [line[a:b].strip() for a, b in zip(cuts[:-1], cuts[1:])]


def _unfinished(cells: list[str]) -> bool:
    """A cell leaves a double-backtick span or a parenthesis open."""
    return any(cell.count("``") % 2 or cell.count("(") > cell.count(")") for cell in cells)


def _rows(lines: list[str], starts: list[int]) -> list[list[str]]:
    """Rows of cells; a line continues the row above when its first column is blank, when it has
    text in the first column only, or when the row above is unfinished."""
    rows: list[list[str]] = []
    for line in lines:
        if not line.strip():
            continue
        cells = _cells(line, starts)
        alone = len(cells) > 1 and not any(cells[1:])
        if rows and (not cells[0] or alone or _unfinished(rows[-1])):
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    return rows


def _markdown_table(header: list[list[str]], body: list[list[str]], ncols: int) -> list[str]:
    head = header[0] if header else [""] * ncols
    out = ["| " + " | ".join(_escape_pipes(c) for c in head) + " |",
           "| " + " | ".join(["---"] * ncols) + " |"]
    for row in header[1:] + body:
        out.append("| " + " | ".join(_escape_pipes(c) for c in row) + " |")
    return out


def simple_tables(text: str) -> str:
    """Replace every reST simple table in ``text`` by a Markdown table."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        borders = [i]
        j = i + 1
        while j < len(lines) and len(borders) < 3:
            if _BORDER.match(lines[j]):
                borders.append(j)
            elif not lines[j].strip():
                break  # a table without a header ends at its second border
            j += 1
        if len(borders) < 2:
            out.append(lines[i])
            i += 1
            continue
        starts = [m.start() for m in re.finditer(r"=+", lines[i])]
        if len(borders) == 3:
            header = _rows(lines[borders[0] + 1:borders[1]], starts)
            body = _rows(lines[borders[1] + 1:borders[2]], starts)
        else:
            header, body = [], _rows(lines[borders[0] + 1:borders[1]], starts)
        if out and out[-1].strip():
            out.append("")
        out.extend(_markdown_table(header, body, len(starts)))
        out.append("")
        i = borders[-1] + 1
    return "\n".join(out)


def sections(text: str) -> str:
    """Replace dash-underlined section titles and list their ``name: description`` items."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        title = lines[i].strip()
        if not (title and i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1])
                and not lines[i][:1].isspace()):
            out.append(lines[i])
            i += 1
            continue
        if out and out[-1].strip():
            out.append("")
        out.extend([f"**{title}**", ""])
        i += 2
        while i < len(lines) and lines[i].strip():
            line = lines[i]
            item = None if line[:1].isspace() else _ITEM.match(line)
            if item:
                names = ", ".join(f"`{n.strip()}`" for n in item.group(1).split(","))
                out.append(f"- {names}: {item.group(2)}")
            elif out and out[-1].startswith("- "):
                out[-1] += " " + line.strip()
            else:
                out.append(line)
            i += 1
    return "\n".join(out)


def term_lists(text: str) -> str:
    """Turn aligned term lists (a paragraph whose first line is a term list item) into lists."""
    lines = text.split("\n")
    out: list[str] = []
    in_list = False
    for i, line in enumerate(lines):
        term = _TERM.match(line) or (_NEXT_TERM.match(line) if in_list else None)
        starts = term and (i == 0 or not lines[i - 1].strip() or in_list)
        if starts:
            if not in_list and out and out[-1].strip():
                out.append("")
            out.append(f"- {term.group(1)}: {term.group(2)}")
            in_list = True
        elif in_list and line[:1].isspace() and line.strip():
            out[-1] += " " + line.strip()
        else:
            in_list = False
            out.append(line)
    return "\n".join(out)


def definitions(text: str) -> str:
    """``term`` / indented text (reST definition lists) -> ``**term**`` followed by the text."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        is_term = (line.strip() and not line[:1].isspace() and not _TERM.match(line)
                   and (i == 0 or not lines[i - 1].strip()) and i + 1 < len(lines)
                   and re.match(r"^ {4,}\S", lines[i + 1]))
        if not is_term:
            out.append(line)
            i += 1
            continue
        out.append(f"**{line.strip()}**")
        i += 1
        while i < len(lines) and lines[i][:1].isspace() and lines[i].strip():
            out.append(lines[i].strip())
            i += 1
    return "\n".join(out)


def _outside_code(text: str, fn) -> str:
    out, last = [], 0
    for match in _CODE.finditer(text):
        out.append(fn(text[last:match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(fn(text[last:]))
    return "".join(out)


def products(text: str) -> str:
    """Escape ``a*b`` outside code spans and indented code blocks."""
    return "\n".join(line if line.startswith("    ") else
                     _outside_code(line, lambda t: _PRODUCT.sub(r"\\*", t))
                     for line in text.split("\n"))


def rewrite(text: str) -> str:
    text = simple_tables(_ROLE.sub(_role, text))
    return products(term_lists(definitions(sections(text))))


class ReSTHabits(griffe.Extension):
    """Rewrite roles and simple tables in every docstring (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
