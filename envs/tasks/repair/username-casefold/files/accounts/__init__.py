"""User accounts: choosing, validating and looking up user names."""

from accounts.names import InvalidName, canonical, validate
from accounts.registry import NameTaken, Registry, UnknownUser

__all__ = ["InvalidName", "NameTaken", "Registry", "UnknownUser", "canonical", "validate"]
