"""README.md is a front door to docs/: every relative link in it and in docs/*.md points to a file
that exists and, with `#anchor`, to a heading of that file; the README stays short and links
every docs page."""
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 150

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")


def prose_lines(text: str):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lowercase, punctuation dropped (hyphens, underscores
    and spaces kept), each space a hyphen."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: pathlib.Path) -> list[str]:
    """The targets of the file's markdown links, outside code blocks and inline code."""
    return [m.group(1) for line in prose_lines(path.read_text())
            for m in LINK.finditer(INLINE_CODE.sub("", line))]


def is_external(target: str) -> bool:
    return re.match(r"(https?:|mailto:)", target, re.IGNORECASE) is not None


def resolve(source: pathlib.Path, target: str) -> tuple[pathlib.Path, str]:
    """(the file a relative link points to, its anchor or "")."""
    file, _, anchor = target.partition("#")
    return (source if not file else (source.parent / file).resolve()), anchor


def broken_links(files) -> list[str]:
    """'file: target (why)' for each relative link that points to no file, or to an anchor that
    its file has no heading for."""
    broken = []
    for source in files:
        for target in links(source):
            if is_external(target):
                continue
            file, anchor = resolve(source, target)
            if not file.exists():
                broken.append(f"{source.name}: {target} (no file {file})")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{source.name}: {target} (no heading #{anchor} in {file.name})")
    return broken


def test_every_relative_link_resolves():
    assert DOCS, "docs/*.md: no pages"
    assert broken_links([README, *DOCS]) == []


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_every_docs_page():
    linked = {resolve(README, t)[0] for t in links(README) if not is_external(t)}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []


def test_slug_is_githubs():
    assert slug("Checkpoints and resume") == "checkpoints-and-resume"
    assert slug("code_exec: running model-written code") == "code_exec-running-model-written-code"
    assert slug("When `rl-train` refuses to start!") == "when-rl-train-refuses-to-start"
    assert slug("What is a ± b?") == "what-is-a--b"


def test_checker_finds_broken_links(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# Page B\n\n## Setup\n\n## Setup\n\n```\n# not a heading\n```\n")
    (tmp_path / "img.png").write_bytes(b"")
    a = tmp_path / "a.md"
    a.write_text(
        "# Page A\n\n## Local part\n\n"
        "good: [b](sub/b.md), [setup](sub/b.md#setup), [second setup](sub/b.md#setup-1), "
        "[here](#local-part), ![pic](img.png), [web](https://example.com/x#y), "
        "[mail](mailto:a@b.c), `[code](missing-in-code.md)`\n\n"
        "bad: [gone](missing.md), [anchor](sub/b.md#nope), [fenced heading](sub/b.md#not-a-heading), "
        "[same file](#nowhere)\n\n"
        "```\n[in a fence](also-missing.md)\n```\n")
    broken = broken_links([a])
    assert [b.split(" (")[0] for b in broken] == [
        "a.md: missing.md", "a.md: sub/b.md#nope", "a.md: sub/b.md#not-a-heading",
        "a.md: #nowhere"]
    (tmp_path / "good.md").write_text("[b](sub/b.md#page-b) [a](a.md#local-part)\n")
    assert broken_links([tmp_path / "good.md"]) == []
