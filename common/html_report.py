"""Self-contained HTML reports: one file with no external reference, its charts embedded as PNG
data URIs, so it can be mailed, attached to a tracking run or opened from object storage as is.

Both stages build their reports here from plain values (training's run report, the dataset
report of ``shardtrain inspect --html``): a ``Page`` of sections holding tables, key/value lists,
preformatted text and charts. It knows nothing about runs or datasets.

Charts are drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas, never through pyplot:
no display is needed, and the backend a notebook chose for its own plots is left alone.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from common.storage import resolve, storage_errors, write_whole

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1.5em; }
dt { font-weight: 600; } dd { margin: 0; font-family: monospace; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 0.85em; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
.note { color: #666; }
"""


@dataclass
class Page:
    """A report: a title, then sections in the order added. ``render`` gives the whole file."""

    title: str
    sections: list[str] = field(default_factory=list)

    def add(self, heading: str, *parts: str) -> None:
        self.sections.append(f"<h2>{escape(heading)}</h2>\n" + "\n".join(parts))

    def render(self) -> str:
        return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{escape(self.title)}</title>"
                f"<style>{_STYLE}</style></head>\n<body>\n<h1>{escape(self.title)}</h1>\n"
                + "\n".join(self.sections) + "\n</body></html>\n")


def escape(value) -> str:
    return html.escape(str(value), quote=True)


def paragraph(text: str, note: bool = False) -> str:
    opening = '<p class="note">' if note else "<p>"
    return f"{opening}{escape(text)}</p>"


def preformatted(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def key_values(pairs: Iterable[tuple[str, object]]) -> str:
    return "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(_cell(v))}</dd>" for k, v in pairs) + "</dl>"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(_cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def line_chart(title: str, xlabel: str, series: dict[str, tuple[Sequence[float], Sequence[float]]],
               ylabel: str = "") -> str:
    """One line per ``series`` entry (label -> (xs, ys)) over integer xs, as an embedded PNG."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o" if len(xs) <= 30 else None, markersize=4, label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs and steps: no tick at 1.25
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return image(figure_png(fig), title)


def bar_chart(title: str, labels: Sequence[str], values: Sequence[float], ylabel: str = "") -> str:
    slanted = len(labels) > 4 or max((len(str(label)) for label in labels), default=0) > 18
    fig, ax = _figure(bottom=0.35 if slanted else 0.14)
    ax.bar(range(len(values)), list(values), color="#4c78a8")
    ax.set_xticks(range(len(labels)), [str(label) for label in labels], rotation=30 if slanted else 0,
                  ha="right" if slanted else "center", fontsize=8)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    return image(figure_png(fig), title)


def scatter_chart(title: str, xlabel: str, series: dict[str, tuple[Sequence, Sequence[float]]], ylabel: str = "",
                  log_x: bool = False, integer_x: bool = False) -> str:
    """Points per ``series`` entry (label -> (xs, ys)); xs that are not numbers are placed as
    categories, in the order first seen."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    xs_all = [x for xs, _ in series.values() for x in xs]
    categories = not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs_all)
    positions = {label: i for i, label in enumerate(dict.fromkeys(str(x) for x in xs_all))} if categories else {}
    for label, (xs, ys) in series.items():
        ax.scatter([positions[str(x)] for x in xs] if categories else list(xs), list(ys), s=24, label=label)
    if categories:
        ax.set_xticks(range(len(positions)), list(positions), fontsize=8)
    elif log_x:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return image(figure_png(fig), title)


def image(png: bytes, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="{png_data_uri(png)}">'


def png_data_uri(png: bytes) -> str:
    if not png.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG image")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def figure_png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


def write_page(uri: str, text: str) -> str:
    """Write a report to ``uri`` (any storage URI); returns the resolved URI."""
    loc = resolve(uri)
    with storage_errors("writing the report", loc.uri):
        write_whole(loc, text.encode("utf-8"))
    return loc.uri


def _figure(bottom: float = 0.14):
    from matplotlib.figure import Figure

    # Fixed margins rather than a layout engine: constrained layout doubles the drawing time.
    fig = Figure(figsize=(7, 3.5), dpi=100)
    fig.subplots_adjust(left=0.11, right=0.97, top=0.9, bottom=bottom)
    return fig, fig.subplots()


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4g}"
    return str(value)


__all__ = ["PNG_SIGNATURE", "Page", "bar_chart", "escape", "figure_png", "image", "key_values", "line_chart",
           "paragraph", "png_data_uri", "preformatted", "scatter_chart", "table", "write_page"]
