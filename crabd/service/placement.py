"""Where a new sandbox is made when crabd is several processes (``[daemon] workers``).

Any process makes the sandboxes asked of it directly (a fork in the
process of its parent: the parent's snapshot and hot images are there).  A
create that reaches the main process (the socket every client starts with)
is placed on the process that serves the fewest sandboxes: the main one
answers WrongShard naming it, before anything is reserved or written, and
the SDK sends the same create there.  Ties are broken at random, away from
the main process, which also serves the host-wide calls; a burst of
concurrent creates that all read the same counts is spread that way too.
"""

from __future__ import annotations

import secrets

from crabd.errors import WrongShard
from crabd.models import ShardPlace


def place_create(place: ShardPlace, loads: list[int]) -> None:
    """Return if the sandbox is made here; else raise WrongShard naming the process that makes it."""
    if place.count == 1 or place.index != 0:
        return
    least = min(loads)
    choices = [i for i, n in enumerate(loads) if n == least]
    if len(choices) > 1 and place.index in choices:
        choices.remove(place.index)
    to = secrets.choice(choices)
    if to != place.index:
        raise WrongShard(
            f"crabd's process {to} makes this sandbox (it serves the fewest); send the create to {place.sockets[to]}",
            sandbox="",
            shard=to,
            socket=place.sockets[to],
        )
