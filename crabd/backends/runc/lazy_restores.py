"""The runc backend's lazy restores in flight: a page server per restore, watched until every page is in.

A lazy restore (``backends/criu/lazypages.py``) returns while its daemon
still serves pages from the restore's image directory, so that directory
and CRIU's work dir stay until the daemon is done, not only until the
start is (``RestoreDirs.remove`` runs when the watch ends).  One thread per
restore waits for its daemon:

* exit 0: every page is in; the guard copies are closed, the dirs removed;
* anything else: the container is killed first (its processes may be
  waiting on a page nobody will serve; none of them may run on with a zero
  page), then the copies are closed, the dirs removed, and the reason kept
  for the container's status (:meth:`LazyRestores.failure`), which is how
  the coordinator learns that the sandbox died and why.

A crabd that starts while a container's lazy restore was in flight under
the previous one (:meth:`LazyRestores.adopt`): if the daemon's recorded
exit status (``lazypages.completed``) is 0, nothing is left to do; if its
supervising shell still runs, it is waited for (by pidfd: it is no child
of this crabd) and the status read after; otherwise the container is
killed, since nothing vouches for its memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from crabd.backends.criu import lazypages
from crabd.backends.runc.cli import CheckpointOptions, Runc
from crabd.backends.runc.ending import RUNNING
from crabd.backends.runc.launch import Launched, Restore
from crabd.backends.runc.restore_dirs import RestoreDirs
from crabd.errors import CrabError

log = logging.getLogger("crabd.runc")

#: How long an adopted daemon (of a crabd that died) may go on serving before its container is killed.
ADOPT_WAIT_S = 600.0


class LazyRestores:
    """The page servers of this backend's lazy restores, by container id.

    ``kill(cid)`` SIGKILLs a container; ``remove_dirs(cid)`` removes its
    restore dirs (both the backend's).
    """

    def __init__(
        self,
        kill: Callable[[str], None],
        remove_dirs: Callable[[str], list[str]],
        *,
        enabled: bool = False,
        min_bytes: int = 32 << 20,
    ) -> None:
        self._kill = kill
        self._remove_dirs = remove_dirs
        self.enabled = enabled
        self.min_bytes = min_bytes
        #: Why this host cannot restore lazily ("" if it can), once asked (None: not yet).
        self._unsupported: str | None = None
        self._lock = threading.Lock()
        self._serving: dict[str, lazypages.PageServer] = {}
        self._watchers: dict[str, threading.Thread] = {}
        self._failed: dict[str, str] = {}

    def begin(self, cid: str, restore: Restore, *, userns: bool) -> tuple[Restore, lazypages.PageServer | None]:
        """How ``cid``'s restore brings its memory back (logged with the reason): ``restore`` as it is
        (eager), or made lazy with its page server already listening.  ``userns``: the container runs in a
        user namespace of its own."""
        if self.enabled and self._unsupported is None:
            self._unsupported = lazypages.unsupported(shutil.which("criu"))
        cannot = self._unsupported or ""
        if self.enabled and not cannot and userns:
            cannot = lazypages.userns_unsupported()
        choice = lazypages.choose(
            enabled=self.enabled,
            page_bytes=lazypages.page_bytes(restore.images_dir),
            min_bytes=self.min_bytes,
            unsupported=cannot,
        )
        if choice.lazy:
            server = lazypages.PageServer(restore.images_dir, restore.work_dir)
            try:
                server.start()
            except CrabError as exc:
                server.close()
                choice = lazypages.PagesChoice(False, f"the page server did not start: {exc.message}")
            else:
                log.info("restoring lazily", extra={"container": cid, "reason": choice.reason})
                opts = dataclasses.replace(restore.options or CheckpointOptions(), lazy_pages=True)
                return dataclasses.replace(restore, options=opts), server
        log.info("restoring eagerly", extra={"container": cid, "reason": choice.reason})
        return restore, None

    def launch(self, cid: str, restore: Restore, run: Callable[..., Launched], *, userns: bool) -> Launched:
        """``run(restore=...)`` (the launcher's launch) lazily when :meth:`begin` says so, eagerly after a
        lazy attempt failed (the launch rolled everything back; the images are intact).  A lazy launch
        that succeeded is guarded and watched from here on (:meth:`watch`)."""
        lazy, server = self.begin(cid, restore, userns=userns)
        if server is None:
            return run(restore=lazy)
        try:
            launched = run(restore=lazy)
        except CrabError as exc:
            server.close()  # nothing of the container runs on its pages
            log.warning("lazy restore failed; restoring eagerly", extra={"container": cid, "error": exc.message})
            return run(restore=restore)
        except BaseException:
            server.close()
            raise
        self.watch(cid, server)
        return launched

    def adopt_all(self, dirs: RestoreDirs, own: Callable[[str], bool], runc: Runc) -> None:
        """Lazy restores a previous crabd left in flight (:meth:`adopt`): waited for, or their containers
        killed."""
        for cid in sorted(set(dirs.names())):  # a cid has an images dir and a work dir: adopted once
            work = dirs.of(cid)[1]
            if own(cid) and (work / lazypages.LOG).exists():
                st = runc.state(cid)
                self.adopt(cid, work, running=st is not None and st.status in RUNNING)

    def serving(self, cid: str) -> bool:
        """Whether ``cid``'s restore still has pages being served (its restore dirs are in use)."""
        with self._lock:
            return cid in self._serving

    def failure(self, cid: str) -> str:
        """Why ``cid`` was killed by its lazy restore's failure ("" if it was not)."""
        with self._lock:
            return self._failed.get(cid, "")

    def watch(self, cid: str, server: lazypages.PageServer) -> None:
        """Guard ``server``'s restore of ``cid`` (it just returned) and watch it to its end in a thread."""
        with self._lock:
            self._serving[cid] = server
            self._failed.pop(cid, None)
        try:
            server.guard()
        except CrabError as exc:
            self._end(cid, server, f"its lazy restore could not be guarded: {exc.message}")
            return
        watcher = threading.Thread(target=self._wait, args=(cid, server), name=f"lazy-pages-{cid}", daemon=True)
        with self._lock:
            self._watchers[cid] = watcher
        watcher.start()

    def _wait(self, cid: str, server: lazypages.PageServer) -> None:
        while True:
            try:
                code = server.wait(lazypages.RELEASE_POLL_S)
                break
            except TimeoutError:
                server.release_done()  # a process whose pages are all in: CRIU's close must unregister
        if code == 0:
            took = time.monotonic() - server.started_at
            extra = {"container": cid, "took_s": round(took, 3), "guarded": server.guarded, "released": server.released}
            log.info("lazy restore complete: every page delivered", extra=extra)
            self._end(cid, server, "")
        else:
            how = lazypages.describe_exit(code)
            self._end(cid, server, f"its memory's page server (criu lazy-pages) failed ({how}): {server.failure()}")

    def _end(self, cid: str, server: lazypages.PageServer, failure: str) -> None:
        """The restore's end: on ``failure``, the container is killed before the guards go.

        A restore :meth:`stop` ended (the container is being removed) is no failure.
        """
        with self._lock:
            if self._serving.get(cid) is not server:
                failure = ""
        if failure:
            extra = {"container": cid, "error": failure, "guarded": server.guarded}
            log.error("lazy restore failed: container killed", extra=extra)
            try:
                self._kill(cid)
            except CrabError as exc:
                log.error("cannot kill a container whose pages failed", extra={"container": cid, "error": str(exc)})
        server.close()
        with self._lock:
            if self._serving.get(cid) is server:
                del self._serving[cid]
            self._watchers.pop(cid, None)
            if failure:
                self._failed[cid] = failure
        left = self._remove_dirs(cid)
        if left:
            log.warning("restore dirs not removed", extra={"container": cid, "errors": left})

    def settled(self, cid: str, timeout_s: float) -> None:
        """Wait until ``cid``'s memory is whole (its lazy restore delivered every page, or ended), at most
        ``timeout_s``: a dump must not read memory still being served."""
        with self._lock:
            watcher = self._watchers.get(cid)
        if watcher is not None:
            watcher.join(timeout=timeout_s)

    def stop(self, cid: str) -> None:
        """The container is going away: its page server (if any) ends now, the container first."""
        with self._lock:
            server = self._serving.pop(cid, None)
            watcher = self._watchers.get(cid)
        if server is not None:
            self._kill(cid)  # never the guards before the processes
            server.close()  # the watcher then sees the daemon's death and removes the dirs
        if watcher is not None:
            watcher.join(timeout=30)
        with self._lock:
            self._failed.pop(cid, None)

    def adopt(self, cid: str, work_dir: Path, running: bool) -> None:
        """A lazy restore of ``cid`` that the previous crabd left in flight (module docstring)."""
        if lazypages.completed(work_dir):
            self._remove_dirs(cid)
            return
        pid = lazypages.daemon_pid(work_dir)
        try:
            pidfd = os.pidfd_open(pid) if pid is not None and running else None
        except OSError:  # gone (ESRCH), or not a pid at all
            pidfd = None
        if pidfd is None:
            self._orphaned(cid, work_dir, running)
            return
        threading.Thread(
            target=self._wait_adopted, args=(cid, work_dir, pidfd), name=f"lazy-pages-{cid}", daemon=True
        ).start()

    def _wait_adopted(self, cid: str, work_dir: Path, pidfd: int) -> None:
        try:
            select.select([pidfd], [], [], ADOPT_WAIT_S)
        finally:
            os.close(pidfd)
        if lazypages.completed(work_dir):
            self._remove_dirs(cid)
        else:
            self._orphaned(cid, work_dir, True)

    def _orphaned(self, cid: str, work_dir: Path, running: bool) -> None:
        if running:
            why = "its lazy restore was in flight when crabd stopped, and its page server did not complete"
            log.error("container killed: its memory is not vouched for", extra={"container": cid, "error": why})
            try:
                self._kill(cid)
            except CrabError as exc:
                log.error("cannot kill an unvouched container", extra={"container": cid, "error": str(exc)})
            with self._lock:
                self._failed[cid] = why
        self._remove_dirs(cid)
