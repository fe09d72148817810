"""Markdown tables of the benchmarks' results pages."""
from __future__ import annotations


def markdown_table(titles: list[str], rows: list[list[str]]) -> str:
    """A header of `titles`, then one line of cells a row."""
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def formatted(key: str, value, fmt: str) -> str:
    """One cell of the emulation's tables: who set the pace, the audit's verdict, "-" for a missing value, else
    `fmt` of the value."""
    if key == "cpu_paced":
        return "CPU-PACED (this machine)" if value else "emulated hardware"
    if key == "audit_ok":
        return "PASS" if value else "FAIL"
    return "-" if value is None or value == "" or value != value else fmt.format(value)  # value != value: NaN
