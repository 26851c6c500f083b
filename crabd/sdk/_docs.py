"""The docstrings of the SDK's public methods, written once for the sync and the async twin.

:func:`crabd.sdk._core.documented` puts them on :class:`Client` and
:class:`AsyncClient` (and their sandboxes and sessions), so ``help()``
shows the same text for both; the async methods are awaited.  A public
method without an entry here fails at import.
"""

from __future__ import annotations

CLIENT = {
    "embedded": "Start a private crabd (temporary socket and state) owned by this client; closing the client stops it.",
    "close": "Close the connection, and stop the embedded crabd this client started; later calls raise ClientClosed.",
    "status": "Is crabd up, and what is it serving (version, pid, state dir, socket, proxy URL)?",
    "engine_status": "The host engine's queue, recent jobs (yours; root: all) and metrics.",
    "create": """Create and start a sandbox.

        ``checkpoints="auto"`` (the default) checkpoints at creation and, at
        every turn end, what the inspector finds the turn needs (nothing,
        files, or processes and files); ``"fs"`` and ``"full"`` take that
        kind at every turn end; ``"none"`` only when asked.  The parameters
        are :class:`crabd.sdk.CreateOptions`'s.
        """,
    "create_from": "Create and start a sandbox described by a :class:`crabd.sdk.CreateOptions` (see :meth:`create`).",
    "list": "The sandboxes visible to you (yours; root: all).",
    "get": "A handle on one sandbox, by id or name.",
    "checkpoints": """Checkpoints of one sandbox, or every one visible to you, each flagged ``remote`` when the
        remote tier holds it; ``include_remote``: also those only the remote tier holds (``remote_only``:
        a fork or restore fetches them first).""",
    "checkpoint": "One checkpoint with what changed in it, its session state and its lineage.",
    "delete_checkpoint": "Delete a checkpoint (its children stay restorable); returns bytes freed.",
    "pin": "Pin a checkpoint: no retention policy thins it (``kept_for`` then includes ``pinned``).",
    "unpin": "Unpin a checkpoint: the sandbox's retention policy may thin it again (queued at once).",
    "set_retention": """Give a sandbox its own retention policy (:class:`crabd.models.RetentionPolicy`; None: the
        daemon's ``[retention]`` default).  Thinning by it is queued in the background at once.""",
    "thin": """Thin a sandbox's checkpoints by its retention policy now; ``dry_run``: only say which
        would go.  Heads, line ends, fork origins, branch points, roots and pinned checkpoints are
        never thinned (docs/retention.md).""",
    "fork": """``n`` new, independent sandboxes with the checkpoint's files and session state: a list
        that is also a context manager (``with``, or ``async with`` for the async client) removing
        them at exit.""",
    "tree": "The checkpoint tree of one sandbox, or the tree that holds one checkpoint.",
    "checkpoint_failures": "Checkpoints that were attempted and not made, newest first, with why (and CRIU's log).",
    "gc": "Remove blobs nothing references (root only).",
    "quota": "Use against the per-uid quotas: the caller's own, or (root) ``uid``'s.",
    "verify": "Re-hash stored checkpoint data; name corrupt blobs and the checkpoints that need them.",
    "push": """Upload a checkpoint to the remote tier now and wait until it is ``remote`` (crabd uploads
        every checkpoint in the background anyway); says what moved.""",
    "export_checkpoint": """Write a portable archive of a checkpoint to ``target`` (a path, or a binary file
        open for writing): its files, session state, process image and every blob they need, with a
        manifest of hashes and the CRIU, kernel and architecture it needs.  ``ancestors``: its
        ancestors on its line too (blobs once), so earlier turns restore after an import.  crabd
        streams the bytes; the file is written here, with your permissions.  Returns the archive's
        size.  See docs/checkpoints.md, "Portable archives".""",
    "import_checkpoint": """Import a portable archive from ``source`` (a path, or a binary file open for
        reading) as your checkpoints: every hash is verified before anything is visible, and a bad
        archive changes nothing (:class:`~crabd.errors.ArchiveRejected`).  A process image this
        host cannot restore (another architecture, an older CRIU or kernel) is left out with the
        reason (``ImportResult.dropped``); files and session still import.  Fork the result with
        :meth:`fork`.""",
    "sync_store": "Re-read the remote tier's manifests into this host's index of remote checkpoints (root only).",
    "import_sandbox": """Bring the checkpoint's own sandbox to this host (a migration, or its host
        was lost): it keeps its id, name, owner and lineage, and its turns go on from the
        checkpoint's.  A checkpoint only the remote tier holds is fetched and verified first.
        ``last_turn``: the last turn the sandbox is known to have ended on its old host; the
        turns after the checkpoint's up to it are reported in ``lost_turns``.""",
}

#: ``run``'s ``turn`` parameter, the same for a program and for session text.
_AS_TURN = """

        ``turn="deferred" | "decided" | "durable"``: the command is a turn of its own, in one call
        (what ``begin_turn()``, the command and ``end_turn()`` do in three; a read-only turn costs
        crabd about a third less).  The word says when the call returns after the turn end: once
        it is closed (the decision is made in the background, as ``end_turn(decision=False)``),
        once it is decided, or once its checkpoint is durable (``end_turn(wait=True)``; a failed
        checkpoint raises).  The ended turn is the result's ``ended_turn``.  If the command
        fails, the turn is ended all the same and the command's error is raised."""

SESSION = {
    "run": "Run bash text in the session and wait for it; ``cd``, ``export`` and variables persist." + _AS_TURN,
    "stream": "Like :meth:`run`, but yield output chunks as they arrive, then the :class:`ExecResult`.",
    "state": "The session's semantic state now (cwd, env, variables, functions, ...).",
    "restart": "Start a fresh bash, with ``state`` (from :meth:`state`) applied if given.",
    "open": """Open this named session now: the container's environment (none with ``empty_env``) plus
        ``env``, in ``workdir`` (default: the sandbox's), as ``user`` ("uid" or "uid:gid"; default root).

        Without it a named session opens at its first command with those defaults.""",
    "close": "End this session's bash (refused while it runs a command); a named one is gone.",
}

SANDBOX = {
    "refresh": "Fetch the sandbox's current description into ``info``, and return it.",
    "run": "Run one program (argv list, or a string split like a shell would) and wait for it." + _AS_TURN,
    "stream": "Like :meth:`run`, but yield output chunks as they arrive, then the :class:`ExecResult`.",
    "begin_turn": "Begin a turn (one agent action) explicitly; :meth:`turn` does it for a ``with`` block.",
    "llm_base_url": """The OpenAI ``base_url`` that routes this sandbox's LLM calls through crabd's proxy.

        Each request then ends the sandbox's turn, and its answer is released
        once the turn's checkpoint is durable.  InvalidRequest if crabd runs
        without the proxy (``[proxy] enabled``).
        """,
    "end_turn": """End the turn.  crabd decides now and checkpoints in the background.

        The sandbox's next action (command, ``begin_turn``, restore, ...)
        waits until that checkpoint is durable, so the state it captures is
        this turn end's.  ``wait=True`` returns only then, with
        ``checkpoint_id`` set, and raises :class:`CheckpointFailed` if it failed.
        ``decision=False`` returns as soon as the turn is closed, without the
        inspector's decision (``decision`` is None, ``checkpoint_state``
        "pending"): under the ``auto`` policy the inspector then decides in
        the background too, and ``turns()`` shows it; the next action waits
        for both.  Agents that do not read the decision lose nothing by it.
        """,
    "turn": """``with sb.turn():`` — one agent action; the turn ends (and is recorded) on exit, also on an
        error.  The turn ends with ``end_turn(decision=False)``: the decision is made in the background.""",
    "turns": "The sandbox's turns, oldest first, with the commands run in each (``limit``: only the last N).",
    "sessions": 'The sandbox\'s sessions whose bash runs: the default one (name "") first, then the named ones.',
    "stop": "Stop the sandbox's container (it can then only be removed); waits up to ``timeout`` s for it.",
    "remove": "Remove the sandbox.  Its checkpoints go too, unless kept or forked from.",
    "checkpoint": """Take a checkpoint now: ``kind="fs"`` (files and the session's state), ``"full"`` (every
        process too, with CRIU), or ``""`` for the sandbox's policy.""",
    "checkpoints": "This sandbox's checkpoints.",
    "restore": """Roll back (or forward) in place: files and session become exactly the checkpoint's.

        Name a checkpoint, or ``turn=N`` for the state this sandbox ended its
        turn N in — on the line of history where that turn happened, also after
        restores (an error if no checkpoint holds that state, e.g. its
        checkpoint failed).  Processes do not survive a filesystem restore;
        ``info.not_restored`` lists what could not be brought back.
        """,
    "fork": """``n`` new sandboxes from ``checkpoint``, or from the state at the end of ``turn=N``
        (default: this sandbox's latest checkpoint).  The result is a list that is also a context
        manager: ``with sb.fork(3) as branches:`` (``async with await sb.fork(3) as ...``) removes
        them at exit.""",
    "tree": "This sandbox's checkpoint tree.",
    "recover": """Recreate this sandbox, whose container died, from its latest checkpoint.

        The result says which turns' effects were lost (they came after that checkpoint).
        """,
}

#: The async client closes with ``aclose`` (as asyncio's own closables do).
ASYNC_ALIASES = {"aclose": "close"}
