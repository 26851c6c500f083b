"""Typed application settings from environment variables and .env files."""

from appconfig.dotenv import parse_dotenv
from appconfig.settings import ConfigError, MissingSetting, Settings

__all__ = ["ConfigError", "MissingSetting", "Settings", "parse_dotenv"]
