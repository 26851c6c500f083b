"""Version strings for the release scripts."""

from vertools.constraints import satisfies
from vertools.semver import Version, compare, parse

__all__ = ["Version", "compare", "parse", "satisfies"]
