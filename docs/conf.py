"""Sphinx configuration: ``make docs`` (figures first, then ``sphinx-build -W``)."""

import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

project = "distdl"
author = "the distdl developers"
copyright = "the distdl developers"
release = version = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax",
              "sphinx.ext.viewcode"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_generated/*.md"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_theme_options = {"description": "exact-adjoint distributed deep learning over MPI", "fixed_sidebar": True,
                      "page_width": "1180px", "sidebar_width": "240px"}

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# No default "members": each page names what it documents (with Sphinx 9 a default of True documents a
# module's whole __all__, internal helpers included, whatever the page lists).
autodoc_default_options = {}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True


def _prepare(app):
    """Draw the figures (if missing) and gather the latest benchmark reports for the performance page."""
    import make_figures

    figures = HERE / "_static" / "figures"
    if not (figures / "partitions.png").exists():
        make_figures.main(figures)
    generated = HERE / "_generated"
    generated.mkdir(exist_ok=True)
    (generated / "benchmarks.md").write_text(benchmark_reports(ROOT / "benchmarks" / "results", figures))


def benchmark_reports(results: Path, figures: Path) -> str:
    """Return every report in ``results`` as MyST: headings demoted, images copied next to the figures."""
    reports = sorted(results.glob("*.md")) if results.is_dir() else []
    if not reports:
        return "No benchmark report is recorded yet: run `make bench`.\n"
    figures.mkdir(parents=True, exist_ok=True)
    lines = []
    for report in reports:
        shown = set()

        def image(match):
            source = results / match.group(2)
            if not source.is_file():
                return f"({match.group(1) or 'image'}: `{match.group(2)}` is missing)"
            shutil.copy(source, figures / source.name)
            shown.add(source.name)
            return f"![{match.group(1)}](/_static/figures/{source.name})"

        text = re.sub(r"!\[([^\]]*)\]\((?!https?:)([^)\s]+)\)", image, report.read_text())
        # Other relative links point into benchmarks/results, which the site does not carry: name the file.
        text = re.sub(r"(?<!!)\[([^\]]*)\]\((?!https?:|#)([^)\s]+)\)", r"\1 (`benchmarks/results/\2`)", text)
        lines.append(f"### `benchmarks/results/{report.name}`\n")
        lines += [("###" + line) if line.startswith("#") else line for line in text.splitlines()]
        lines.append("")
        for picture in sorted(results.glob(report.stem + "*.png")):
            if picture.name not in shown:
                shutil.copy(picture, figures / picture.name)
                lines.append(f"![{picture.stem}](/_static/figures/{picture.name})\n")
    return "\n".join(lines) + "\n"


_UNPACKING = re.compile(r"(?<=[(, ])\*(?=[A-Za-z_]\w*[),])")


def _escape_unpacking(app, what, name, obj, options, lines):
    """Escape shapes written as ``(N, C, *spatial)`` outside literals, which RST reads as emphasis."""
    for k, line in enumerate(lines):
        parts = line.split("``")
        lines[k] = "``".join(_UNPACKING.sub(r"\\*", part) if i % 2 == 0 else part for i, part in enumerate(parts))


def setup(app):
    app.connect("builder-inited", _prepare)
    app.connect("autodoc-process-docstring", _escape_unpacking)
