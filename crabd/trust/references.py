"""Declared references and bounded expansion of checkpoints that arrive from outside this host.

An archive (``coordinator/archives.py``) or a bucket manifest
(``coordinator/replication.py``) *declares* which blobs name which others
(its ``edges``); the catalog records those edges as they are, and a restore
reads whatever blob an index page or a process image names.  Nothing made
the two agree: an imported index could name a blob the archive never
carried, and a fork then read another tenant's file of that address (and
its failure told whether one existed).  Small metadata could also name one
page or pack over and over, and a restore wrote that out every time.

:meth:`ReferenceChecker.check` runs after the foreign blobs are verified
(hashes) and before anything is adopted, for the records to adopt:

1. parse each record's index (``FsDelta.outline``) and process image
   (``ProcessImages.outline``) with the backends' own decoders, through a
   reader that serves only blobs the input *carries* (the archive's blobs,
   the objects a fetch read) or that the importer *owns* already (charged
   to it by a checkpoint it holds).  A blob outside both is refused with one
   message, built from the input alone, before anything else is looked up:
   a blob that exists here under another owner and one that exists nowhere
   are indistinguishable (same error, no store lookup, no timing
   difference);
2. the references found must equal the declared edges of the blobs those
   records need, exactly: no edge more, none fewer; and what the metadata
   says of a data blob's size must be its verified size;
3. each record's expansion — entries created, bytes written by a restore
   (file extents and image files, every repeated reference to one page or
   pack counted again) — must stay within :class:`Bounds` (configured
   limits, the importer's quota, the free space a restore would write to).
   The backends refuse past their own limits while parsing, so a root
   naming one page 200,000 times stops at its header, before any page.

Every refusal is the caller's error type (``reject(message, reason)``), with
nothing adopted; reasons: ``references`` (undeclared, missing or malformed)
and ``bounds`` (expansion).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from crabd.backends.fsdelta import FsDelta, Outline, OutlineMemo, ReadBlob
from crabd.backends.procdump import ProcessImages
from crabd.errors import CrabError, StoreFull, TooManyEntries
from crabd.models import CheckpointRecord

#: Builds the caller's refusal from a message and a reason word.
Reject = Callable[[str, str], CrabError]


@dataclass(frozen=True)
class Bounds:
    """What one restore of an imported checkpoint may create (entries) and write (bytes)."""

    max_entries: int
    max_bytes: int
    #: Where the limit on bytes comes from, for the message (e.g. "the limit", "free space").
    why: str = "the limit"


@dataclass(frozen=True)
class Expansion:
    """What restoring one checkpoint creates and writes."""

    entries: int
    bytes: int


class ReferenceChecker:
    """Parses imported metadata with the backends' decoders; checks references and expansion (module doc)."""

    def __init__(self, fs: FsDelta, images: ProcessImages) -> None:
        self.fs = fs
        self.images = images

    def check(
        self,
        records: Iterable[CheckpointRecord],
        declared: dict[str, list[str]],
        carried: set[str],
        owned: set[str],
        read: ReadBlob,
        bounds: Bounds,
        reject: Reject,
        *,
        sizes: dict[str, int] | None = None,
        what: str = "the archive",
    ) -> dict[str, Expansion]:
        """Steps 1-3 of the module doc for ``records``; each one's expansion, or ``reject(...)`` raised.

        ``declared``: the input's edges; ``carried``: the blobs the input holds
        (verified); ``owned``: blobs already charged to the importer; ``read``:
        the content of a carried or owned blob; ``sizes``: verified content
        sizes of blobs, against which what the metadata says of them is checked
        (a restore of an image file or extent of another size would fail).
        """
        readable = carried | owned

        def guarded(hex_: str, limit: int) -> bytes:
            if hex_ not in readable:
                raise _Uncarried(hex_)
            return read(hex_, limit)

        memo: OutlineMemo = {}
        found: dict[str, set[str]] = {}
        roots: set[str] = set()
        out: dict[str, Expansion] = {}
        for rec in records:
            index, process = rec.index_blob, rec.process_blob
            fs = _outline(partial(self.fs.outline, index, guarded, memo), rec, reject, what)
            img = Outline()
            if process:
                img = _outline(partial(self.images.outline, process, guarded), rec, reject, what)
            for outline in (fs, img):
                for parent, kids in outline.children.items():
                    found.setdefault(parent, set()).update(kids)
                for blob, size in outline.sizes.items():
                    if sizes is not None and blob in sizes and sizes[blob] != size:
                        raise reject(
                            f"checkpoint {rec.id}'s metadata says blob {blob} holds {size} bytes; it holds"
                            f" {sizes[blob]}",
                            "references",
                        )
            roots |= {b for b in (rec.index_blob, rec.delta_blob, rec.session_blob, rec.process_blob) if b}
            exp = Expansion(fs.entries + img.entries, fs.bytes + img.bytes)
            if exp.entries > bounds.max_entries or exp.bytes > bounds.max_bytes:
                raise reject(
                    f"restoring checkpoint {rec.id} would create {exp.entries} entries and write {exp.bytes} bytes;"
                    f" {bounds.why} here is {bounds.max_entries} entries and {bounds.max_bytes} bytes",
                    "bounds",
                )
            out[rec.id] = exp
        for hex_ in sorted(roots | {k for kids in found.values() for k in kids}):
            if hex_ not in readable:
                raise reject(_not_carried(hex_, what), "references")
        problem = _edges_problem(found, declared, roots)
        if problem:
            raise reject(f"{what}'s declared references do not match its metadata: {problem}", "references")
        return out


class _Uncarried(Exception):
    """A parse asked for a blob the input neither carries nor the importer owns."""

    def __init__(self, hex_: str) -> None:
        super().__init__(hex_)
        self.hex = hex_


def _outline(parse: Callable[[], Outline], rec: CheckpointRecord, reject: Reject, what: str) -> Outline:
    """One backend outline, its failures as the caller's refusal."""
    try:
        return parse()
    except _Uncarried as exc:
        raise reject(_not_carried(exc.hex, what), "references") from None
    except (TooManyEntries, StoreFull) as exc:
        raise reject(f"checkpoint {rec.id} is too big to restore here: {exc.message}", "bounds") from exc
    except CrabError as exc:
        raise reject(f"checkpoint {rec.id}'s metadata is malformed: {exc.message}", "references") from exc


def _not_carried(hex_: str, what: str) -> str:
    # One message whatever this host holds under that address: no oracle on other tenants' blobs.
    return f"{what} references blob {hex_}, which it does not carry and which is not one of your checkpoints' blobs"


def _edges_problem(found: dict[str, set[str]], declared: dict[str, list[str]], roots: set[str]) -> str:
    """Whether the parsed references are the declared edges of the blobs ``roots`` need ("" if equal)."""
    want = {p: kids for p, kids in found.items() if kids}
    needed: set[str] = set()
    todo = list(roots)
    while todo:
        b = todo.pop()
        if b not in needed:
            needed.add(b)
            todo.extend(declared.get(b, ()))
    have = {p: set(declared[p]) for p in needed if declared.get(p)}
    for parent in sorted(want.keys() | have.keys()):
        extra, missing = (
            have.get(parent, set()) - want.get(parent, set()),
            want.get(parent, set()) - have.get(parent, set()),
        )
        if missing:
            return f"blob {parent} names {sorted(missing)[0]}, which is not declared"
        if extra:
            return f"blob {parent} is declared to name {sorted(extra)[0]}, which it does not"
    return ""
