"""Markdown tables of the benchmarks' results pages."""
from __future__ import annotations


def markdown_table(titles: list[str], rows: list[list[str]]) -> str:
    """A header of `titles`, then one line of cells a row."""
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)
