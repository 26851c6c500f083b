"""Parsing and querying logfmt logs (``key=value key2="quoted value"``)."""

from logscan.parse import parse_line, parse_lines
from logscan.query import count_by, parse_duration, select, slowest

__all__ = ["count_by", "parse_duration", "parse_line", "parse_lines", "select", "slowest"]
