"""The choices a command line offers: output formats and ownership policies, as enums.

Typer validates them and lists them in `--help`; the core and the renderers take the members.
This module imports nothing, so `--help` stays fast.
"""

from __future__ import annotations

from enum import Enum


class ParamsFormat(str, Enum):
    """`params --format`: the semicolon table, JSON, or a table for people."""

    csv = "csv"
    json = "json"
    table = "table"


class TopologyFormat(str, Enum):
    """`topology --format`: the ProcessCoord line, or one row per rank."""

    line = "line"
    table = "table"


class MemoryFormat(str, Enum):
    """`memory --format`: text with a bar chart, exact bytes, or JSON."""

    text = "text"
    table = "table"
    json = "json"


class DiffFormat(str, Enum):
    """`diff --format`: text, markdown for a pull request, or JSON."""

    text = "text"
    markdown = "markdown"
    json = "json"


class Partitioning(str, Enum):
    """`params --partitioning`: who owns a parameter's optimizer work (docs/params-table.md)."""

    layers = "layers"
    cost = "cost"
    distopt = "distopt"


class WorkloadFormat(str, Enum):
    """`workload --format`: SimAI's workload files (room for other simulators' formats)."""

    simai = "simai"


class PlanFormat(str, Enum):
    """`plan --format`: the ranked table with flags and timeline, or JSON."""

    text = "text"
    json = "json"


class CheckFormat(str, Enum):
    """`check --format`: the log beside the prediction for people, or JSON."""

    text = "text"
    json = "json"
