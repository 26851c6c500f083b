"""An in-memory registry of accounts, keyed by canonical name."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from accounts.names import canonical, validate

RESERVED = ("admin", "root", "support", "system")


class NameTaken(Exception):
    """The name, or one that is the same after canonicalisation, is already used."""


class UnknownUser(LookupError):
    pass


@dataclass
class Account:
    name: str  # as displayed
    email: str
    created: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


class Registry:
    def __init__(self) -> None:
        self._accounts: dict[str, Account] = {}
        self._reserved = {canonical(n) for n in RESERVED}

    def __len__(self) -> int:
        return len(self._accounts)

    def __contains__(self, name: str) -> bool:
        return canonical(name) in self._accounts

    def register(self, name: str, email: str) -> Account:
        display = validate(name)
        key = canonical(display)
        if key in self._reserved:
            raise NameTaken(f"{display!r} is reserved")
        if key in self._accounts:
            raise NameTaken(f"{display!r} is already taken (by {self._accounts[key].name!r})")
        account = Account(display, email.strip())
        self._accounts[key] = account
        return account

    def lookup(self, name: str) -> Account:
        try:
            return self._accounts[canonical(name)]
        except KeyError:
            raise UnknownUser(name) from None

    def rename(self, old: str, new: str) -> Account:
        account = self.lookup(old)
        display = validate(new)
        key, old_key = canonical(display), canonical(account.name)
        if key != old_key and (key in self._accounts or key in self._reserved):
            raise NameTaken(f"{display!r} is already taken")
        del self._accounts[old_key]
        account.name = display
        self._accounts[key] = account
        return account
