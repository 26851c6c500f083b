"""Configuration loading for the order service."""

from svcconf.loader import ConfigError, Settings, load

__all__ = ["ConfigError", "Settings", "load"]
