/*
 * crab's inspector probes: what a sandbox's processes do to files and to each other.
 *
 * Loaded by crabd with bcc (crabd/inspector/bpf.py), through tracepoints only:
 * this kernel has no kprobes, and BPF trampolines (fentry, BPF LSM) are not
 * available to load here either.  One set of programs serves every sandbox on
 * the host.  An event belongs to a sandbox when the cgroup of the calling task
 * at level SANDBOX_CGROUP_LEVEL (cgroup v2; Docker puts a container at
 * /docker/<id>, level 2) is a key of `sandboxes`; processes in child cgroups
 * of a sandbox are attributed to it through the same ancestor.  Everything
 * else returns at once.
 *
 * DECISIONS COME FROM KERNEL OBJECTS, NEVER FROM PATH STRINGS.  What decides
 * is the marks in `counts`, per sandbox three monotonically increasing
 * counters, bumped in the kernel and never reset (userspace remembers the
 * last value it saw, so a mark that lands while userspace reads cannot be
 * lost; the other counters of `counts` work the same way):
 *
 *   MARK_FILES  something may have changed the sandbox's files: userspace
 *               then compares the upper dir with the head exactly (net).
 *   MARK_PROC   something may have changed a process's memory while it did
 *               not run (ptrace, process_vm_writev, a write to a /proc file
 *               such as /proc/<pid>/mem, io_uring, AIO).
 *   MARK_TMPFS  something may have changed what the sandbox's tmpfs and
 *               mqueue mounts hold (only a process checkpoint keeps it):
 *               userspace then fingerprints those mounts again
 *               (crabd/inspector/mounts.py); without it, the last
 *               fingerprint stands.
 *
 * Attribution, by syscall family (docs/inspector.md has the argument):
 *   - fd-based mutations (write family, ftruncate, fallocate, fchmod, fchown,
 *     f*xattr, futimens, ioctl, copy_file_range/sendfile/splice into fd_out,
 *     mmap MAP_SHARED of a file open for writing): the fd is looked up in the
 *     task's own fd table (task->files->fdt->fd[fd]) and its inode classified;
 *     the mark is taken at entry AND again at exit when the call succeeded, so
 *     data that lands after userspace read the counters is counted for the
 *     next turn.
 *   - opens (open, openat, openat2, creat) with O_WRONLY/O_RDWR/O_CREAT/O_TRUNC:
 *     the fd the call returned is classified at exit.  The path string plays
 *     no part: `/dev/pts/../../work/x`, `/dev/fd/5/z` or a symlinked directory
 *     all end at the inode actually opened.
 *   - path-based mutations (unlink, rename, link, symlink, mkdir, rmdir, mknod,
 *     chmod, chown, xattrs, utimes, truncate; every *at and 2 variant): always
 *     MARK_FILES, at entry and at exit.  No path is resolved.
 *   - a process dumping core (the kernel writes the file, no syscall).
 *   - io_uring and AIO (the kernel does the I/O): MARK_FILES and MARK_PROC.
 *   - ptrace (not TRACEME), process_vm_writev: MARK_PROC and MARK_FILES (the
 *     traced process can be made to do anything).
 * An inode is "quiet" (no mark) only when it is certainly not state a
 * checkpoint keeps: a character or block device, a fifo, a socket, an
 * anonymous inode, or a file on procfs (MARK_PROC instead), sysfs,
 * cgroupfs, devpts, pipefs, sockfs, nsfs, bpffs, debugfs/tracefs/securityfs.
 * A file on tmpfs or mqueue takes MARK_TMPFS instead of MARK_FILES (its
 * content is not in the upper dir).  MARK_TMPFS also comes with every
 * path-based mutation (no path is resolved, so it may be on a tmpfs), every
 * mount-table change (mount, umount, move_mount, fsmount, mount_setattr,
 * open_tree, pivot_root: a tmpfs appears or goes), every POSIX message queue
 * call (mq_open, mq_unlink, mq_timedsend, mq_timedreceive, mq_notify,
 * mq_getsetattr: they change an mqueue file without any write), and with
 * everything uncertain.  Writes through a shared mapping of a tmpfs file make
 * no syscall: userspace fingerprints at every turn end while a process has
 * one (crabd/inspector/procs.py).  Anything the probe cannot read counts as a
 * mark: where the probes cannot tell, the answer is "changed".
 *
 * TASKS are counted too: every task (process or thread) a task of the sandbox
 * forks, every task of the sandbox that exits.  As many exits as forks since
 * a read of /proc that found only crab's processes and the session's bash
 * means every task begun since is gone again: userspace then takes that read
 * as it stands instead of reading /proc (crabd/inspector/vouched.py, which
 * also compares the cgroup's pid list and checks that none of them exec'd).
 *
 * Kernel structs are read at byte offsets passed in as -D flags that crabd
 * takes from the running kernel's BTF (crabd/inspector/btf.py): the host's
 * kernel headers may describe another kernel's layout.
 *
 * EVENTS only explain (paths for the reasons shown to users, short-lived
 * process names, 32-bit executables).  They go to one ring buffer; past
 * EVENT_BUDGET per sandbox per epoch only a count is kept.  Userspace still
 * treats lost events and a spent budget as "files changed" because a 32-bit
 * process's syscalls reach no syscalls:* tracepoint and its exec event is the
 * only sign of it.
 *
 * Parameters come in through cflags (never by editing this text):
 *   SANDBOX_CGROUP_LEVEL  the cgroup level of a sandbox (default 2)
 *   MAX_SANDBOXES         slots in the per-sandbox maps
 *   PATH_BYTES            bytes kept of each path (explanations only)
 *   RINGBUF_PAGES         size of the event ring buffer, in pages (a power of two)
 *   EVENT_BUDGET          events sent per sandbox per epoch; past it only counted
 *   OFF_*                 struct member offsets of the running kernel (required)
 *   HAVE_<syscall>        the syscall's tracepoint exists on this kernel
 */

#include <uapi/linux/ptrace.h>
#include <linux/aio_abi.h>   /* aio_context_t, in io_setup/io_submit's tracepoint args */
#include <linux/fs.h>        /* rwf_t, in pwritev2's */

#ifndef SANDBOX_CGROUP_LEVEL
#define SANDBOX_CGROUP_LEVEL 2
#endif
#ifndef MAX_SANDBOXES
#define MAX_SANDBOXES 1024
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 1024
#endif
#ifndef EVENT_BUDGET
#define EVENT_BUDGET 64
#endif
#ifndef PATH_BYTES
#define PATH_BYTES 1024
#endif

/* event kinds */
#define EV_OPEN      1   /* open/openat/openat2/creat for writing: path, dfd, flags */
#define EV_PATH      2   /* a path-based mutation: path, dfd, op */
#define EV_PATH2     3   /* rename/link/symlink: path (old/target), path2 (new), dfd, dfd2, op */
#define EV_FD        4   /* an fd-based mutation of a file that is not quiet: fd, op */
#define EV_FORK      5   /* (unused: forks and exits are counted in `counts`) */
#define EV_EXEC      6   /* path = filename */
#define EV_EXIT      7   /* a process dumped core */
#define EV_UNCERTAIN 8   /* op says why: ptrace, process_vm_writev, io_uring, aio, open_by_handle, /proc write */

/* flags */
#define F_PATH1_CUT 1
#define F_PATH2_CUT 2

/* ops (for explanations; numbering shared with crabd/inspector/bpf.py) */
#define OP_TRUNCATE 1
#define OP_UNLINK 2
#define OP_MKDIR 3
#define OP_RMDIR 4
#define OP_MKNOD 5
#define OP_CHMOD 6
#define OP_CHOWN 7
#define OP_XATTR 8
#define OP_UTIMES 9
#define OP_RENAME 10
#define OP_LINK 11
#define OP_SYMLINK 12
#define OP_WRITE 13
#define OP_FALLOCATE 14
#define OP_COPY 15
#define OP_MMAP 16
#define OP_PTRACE 17
#define OP_VM_WRITE 18
#define OP_IO_URING 19
#define OP_AIO 20
#define OP_BY_HANDLE 21
#define OP_PROC_WRITE 22
#define OP_IOCTL 23
#define OP_CORE 24

/* marks: per-sandbox counters that decide (see the top of this file) */
#define MARK_FILES 0
#define MARK_PROC 1
#define MARK_TMPFS 2
#define NMARKS 3
/* IN_MARK's flags: which marks its successful exit takes again */
#define M_FILES (1 << MARK_FILES)
#define M_TMPFS (1 << MARK_TMPFS)

/* in-flight syscalls: what the exit probe must do */
#define IN_MARK 1    /* mark files again at a successful exit */
#define IN_OPEN 2    /* classify the returned fd */

/* inode kinds (S_IFMT) and filesystem magics (include/uapi/linux/magic.h) */
#define S_FMT 0170000
#define S_SOCK 0140000
#define S_BLK 0060000
#define S_CHR 0020000
#define S_FIFO 0010000
#define PROC_SUPER_MAGIC 0x9fa0
#define FMODE_WRITE_BIT 0x2

struct event {
    u32 kind;
    u32 op;
    u32 slot;
    u32 tgid;
    u32 tid;
    s32 dfd;
    s32 dfd2;
    s32 fd;
    u64 flags;      /* open flags, or mmap prot|flags<<32 */
    u32 cut;
    u32 _pad;
    char path[PATH_BYTES];
    char path2[PATH_BYTES];
};

struct wkey {
    u32 tgid;
    s32 fd;
};

struct inflight {
    u32 slot;
    u32 what;      /* IN_MARK or IN_OPEN */
    u64 flags;     /* open flags (IN_OPEN) */
};

BPF_HASH(sandboxes, u64, u32, MAX_SANDBOXES);        /* cgroup id -> slot */
/* What the probes count per sandbox slot.  Only ever incremented, never reset: userspace keeps
 * the values it saw and reads all of them in one lookup per turn; an increment that lands while
 * it reads counts for the next turn, so none is lost (a read-then-reset would lose it). */
struct counts {
    u64 marks[NMARKS];
    u64 events;    /* events started (sent or past the budget) */
    u64 dropped;   /* events lost: the ring buffer was full */
    u64 forks;     /* tasks forked (processes and threads) by a task in the sandbox */
    u64 exits;     /* processes that exited (thread-group leaders) */
    u64 task_exits;   /* tasks that exited, threads too: as many as forks = every new task is gone */
};
/* Set by userspace at each turn's take, only read here: the epoch (for the write explanations'
 * dedup) and `events` as it was then (the budget is per epoch). */
struct epoch {
    u64 number;
    u64 events_base;
};
BPF_ARRAY(counts, struct counts, MAX_SANDBOXES);     /* slot -> counters */
BPF_ARRAY(epochs, struct epoch, MAX_SANDBOXES);      /* slot -> epoch */
BPF_TABLE("lru_hash", struct wkey, u64, wseen, 65536);   /* (tgid, fd) -> epoch last reported */
BPF_TABLE("lru_hash", u32, struct inflight, inflight, 65536);   /* tid -> syscall in progress */
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);           /* default 1024 pages: 4 MiB */

static __always_inline int sandbox_slot(u32 *slot) {
    u64 cg = bpf_get_current_ancestor_cgroup_id(SANDBOX_CGROUP_LEVEL);
    u32 *s = sandboxes.lookup(&cg);
    if (!s)
        return 0;
    *slot = *s;
    return 1;
}

static __always_inline void mark(u32 slot, u32 what) {
    struct counts *c = counts.lookup(&slot);
    if (c && what < NMARKS)
        __sync_fetch_and_add(&c->marks[what], 1);
}

static __always_inline void lost(u32 slot) {
    struct counts *c = counts.lookup(&slot);
    if (c)
        __sync_fetch_and_add(&c->dropped, 1);
}

/* Whether the slot's events this epoch reached the budget (then only counted, not sent). */
static __always_inline int spent(u32 slot, struct counts *c) {
    struct epoch *ep = epochs.lookup(&slot);
    u64 base = ep ? ep->events_base : 0;
    return c->events - base >= EVENT_BUDGET;
}

static __always_inline struct event *start(u32 slot, u32 kind, u32 op) {
    /* A turn needs only a few events to be explained.  Past EVENT_BUDGET in
     * one epoch only a count is kept: the cost of a busy build stays in the
     * kernel, not in crabd. */
    if (kind != EV_UNCERTAIN) {
        struct counts *c = counts.lookup(&slot);
        if (!c)
            return 0;
        int over = spent(slot, c);
        __sync_fetch_and_add(&c->events, 1);
        if (over)
            return 0;
    }
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lost(slot);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    e->kind = kind;
    e->op = op;
    e->slot = slot;
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->dfd = -100;   /* AT_FDCWD */
    e->dfd2 = -100;
    e->fd = -1;
    e->flags = 0;
    e->cut = 0;
    e->path[0] = 0;
    e->path2[0] = 0;
    return e;
}

static __always_inline void path1(struct event *e, const char *user) {
    if (!user)
        return;
    long n = bpf_probe_read_user_str(e->path, sizeof(e->path), user);
    if (n >= (long)sizeof(e->path))
        e->cut |= F_PATH1_CUT;
}

static __always_inline void path2(struct event *e, const char *user) {
    if (!user)
        return;
    long n = bpf_probe_read_user_str(e->path2, sizeof(e->path2), user);
    if (n >= (long)sizeof(e->path2))
        e->cut |= F_PATH2_CUT;
}

/* --- kernel objects ------------------------------------------------------------ */

/* The struct file behind `fd` in the calling task's fd table, or 0. */
static __always_inline void *fd_file(int fd) {
    char *task = (char *)bpf_get_current_task();
    char *files = 0, *fdt = 0, **table = 0;
    void *file = 0;
    u32 max = 0;
    if (fd < 0)
        return 0;
    if (bpf_probe_read_kernel(&files, sizeof(files), task + OFF_TASK_FILES) || !files)
        return 0;
    if (bpf_probe_read_kernel(&fdt, sizeof(fdt), files + OFF_FILES_FDT) || !fdt)
        return 0;
    if (bpf_probe_read_kernel(&max, sizeof(max), fdt + OFF_FDT_MAX_FDS) || (u32)fd >= max)
        return 0;
    if (bpf_probe_read_kernel(&table, sizeof(table), fdt + OFF_FDT_FD) || !table)
        return 0;
    if (bpf_probe_read_kernel(&file, sizeof(file), (char *)(table + fd)))
        return 0;
    return file;
}

#define CLASS_QUIET 0
#define CLASS_FILES 1   /* may be state a filesystem checkpoint keeps */
#define CLASS_PROC 2    /* a /proc file: may be another process's memory */
#define CLASS_TMPFS 3   /* a tmpfs or mqueue file: only a process checkpoint keeps it */
#define TMPFS_MAGIC 0x01021994
#define MQUEUE_MAGIC 0x19800202

static __always_inline int quiet_magic(u64 magic) {
    switch (magic) {
    case 0x62656572:   /* sysfs */
    case 0x27e0eb:     /* cgroup */
    case 0x63677270:   /* cgroup2 */
    case 0x1cd1:       /* devpts */
    case 0x50495045:   /* pipefs */
    case 0x534f434b:   /* sockfs */
    case 0x09041934:   /* anon inodes */
    case 0x6e736673:   /* nsfs */
    case 0xcafe4a11:   /* bpffs */
    case 0x64626720:   /* debugfs */
    case 0x74726163:   /* tracefs */
    case 0x73636673:   /* securityfs */
        return 1;
    }
    return 0;
}

/* What a write through `file` may change.  Unreadable means "files". */
static __always_inline int classify(void *file) {
    char *inode = 0, *sb = 0;
    u16 mode = 0;
    unsigned long magic = 0;
    if (!file)
        return CLASS_FILES;
    if (bpf_probe_read_kernel(&inode, sizeof(inode), (char *)file + OFF_FILE_INODE) || !inode)
        return CLASS_FILES;
    if (bpf_probe_read_kernel(&mode, sizeof(mode), inode + OFF_INODE_MODE))
        return CLASS_FILES;
    switch (mode & S_FMT) {
    case S_CHR:
    case S_BLK:
    case S_FIFO:
    case S_SOCK:
    case 0:             /* anonymous inodes (eventfd, timerfd, ...) have no type */
        return CLASS_QUIET;
    }
    if (bpf_probe_read_kernel(&sb, sizeof(sb), inode + OFF_INODE_SB) || !sb)
        return CLASS_FILES;
    if (bpf_probe_read_kernel(&magic, sizeof(magic), sb + OFF_SB_MAGIC))
        return CLASS_FILES;
    if (magic == PROC_SUPER_MAGIC)
        return CLASS_PROC;
    if (magic == TMPFS_MAGIC || magic == MQUEUE_MAGIC)
        return CLASS_TMPFS;
    return quiet_magic(magic) ? CLASS_QUIET : CLASS_FILES;
}

static __always_inline void remember(u32 slot, u32 what, u64 flags) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct inflight in = {.slot = slot, .what = what, .flags = flags};
    inflight.update(&tid, &in);
}

/* The exit of any syscall that remembered itself: finish what its entry began. */
static __always_inline int on_exit(long ret) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct inflight *in = inflight.lookup(&tid);
    if (!in)
        return 0;
    struct inflight copy = *in;
    inflight.delete(&tid);
    if (ret < 0)
        return 0;   /* failed: it changed nothing */
    if (copy.what == IN_MARK) {
        if (copy.flags & M_FILES)
            mark(copy.slot, MARK_FILES);
        if (copy.flags & M_TMPFS)
            mark(copy.slot, MARK_TMPFS);
        return 0;
    }
    /* IN_OPEN: classify the file actually opened (by any path, dirfd or magic link). */
    int c = classify(fd_file((int)ret));
    if (c == CLASS_FILES)
        mark(copy.slot, MARK_FILES);
    else if (c == CLASS_TMPFS)
        mark(copy.slot, MARK_TMPFS);
    else if (c == CLASS_PROC) {
        mark(copy.slot, MARK_PROC);
        struct event *e = start(copy.slot, EV_UNCERTAIN, OP_PROC_WRITE);
        if (e) {
            e->fd = (s32)ret;
            events.ringbuf_submit(e, 0);
        }
    }
    return 0;
}

/* --- opens for writing -------------------------------------------------------- */

#define WRITE_FLAGS (01 | 02 | 0100 | 01000)   /* O_WRONLY | O_RDWR | O_CREAT | O_TRUNC */

static __always_inline int on_open(int dfd, const char *filename, u64 flags) {
    u32 slot;
    if (!(flags & WRITE_FLAGS) || !sandbox_slot(&slot))
        return 0;
    remember(slot, IN_OPEN, flags);
    struct event *e = start(slot, EV_OPEN, 0);
    if (!e)
        return 0;
    e->dfd = dfd;
    e->flags = flags;
    path1(e, filename);
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat) { return on_open(args->dfd, args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_enter_open) { return on_open(-100, args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_enter_creat) { return on_open(-100, args->pathname, 01 | 0100 | 01000); }
TRACEPOINT_PROBE(syscalls, sys_exit_openat) { return on_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_open) { return on_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_creat) { return on_exit(args->ret); }
#ifdef HAVE_openat2
TRACEPOINT_PROBE(syscalls, sys_enter_openat2) {
    struct { u64 flags; u64 mode; u64 resolve; } how = {};
    bpf_probe_read_user(&how, sizeof(how), args->how);
    return on_open(args->dfd, args->filename, how.flags);
}
TRACEPOINT_PROBE(syscalls, sys_exit_openat2) { return on_exit(args->ret); }
#endif

/* --- path-based mutations --------------------------------------------------------- */

static __always_inline int on_path(u32 op, int dfd, const char *p) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
    mark(slot, MARK_FILES);
    mark(slot, MARK_TMPFS);
    remember(slot, IN_MARK, M_FILES | M_TMPFS);
    struct event *e = start(slot, EV_PATH, op);
    if (!e)
        return 0;
    e->dfd = dfd;
    path1(e, p);
    events.ringbuf_submit(e, 0);
    return 0;
}

static __always_inline int on_path2(u32 op, int dfd, const char *a, int dfd2, const char *b) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
    mark(slot, MARK_FILES);
    mark(slot, MARK_TMPFS);
    remember(slot, IN_MARK, M_FILES | M_TMPFS);
    struct event *e = start(slot, EV_PATH2, op);
    if (!e)
        return 0;
    e->dfd = dfd;
    e->dfd2 = dfd2;
    path1(e, a);
    path2(e, b);
    events.ringbuf_submit(e, 0);
    return 0;
}

/* Entry and exit of one path-based syscall. */
#define PATH_PROBE(name, op, dfd, p)                                                   \
    TRACEPOINT_PROBE(syscalls, sys_enter_##name) { return on_path(op, dfd, p); }       \
    TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return on_exit(args->ret); }
#define PATH2_PROBE(name, op, dfd, a, dfd2, b)                                                  \
    TRACEPOINT_PROBE(syscalls, sys_enter_##name) { return on_path2(op, dfd, a, dfd2, b); }      \
    TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return on_exit(args->ret); }

PATH_PROBE(truncate, OP_TRUNCATE, -100, args->path)
PATH_PROBE(unlink, OP_UNLINK, -100, args->pathname)
PATH_PROBE(unlinkat, OP_UNLINK, args->dfd, args->pathname)
PATH_PROBE(mkdir, OP_MKDIR, -100, args->pathname)
PATH_PROBE(mkdirat, OP_MKDIR, args->dfd, args->pathname)
PATH_PROBE(rmdir, OP_RMDIR, -100, args->pathname)
PATH_PROBE(mknod, OP_MKNOD, -100, args->filename)
PATH_PROBE(mknodat, OP_MKNOD, args->dfd, args->filename)
PATH_PROBE(chmod, OP_CHMOD, -100, args->filename)
PATH_PROBE(fchmodat, OP_CHMOD, args->dfd, args->filename)
#ifdef HAVE_fchmodat2
PATH_PROBE(fchmodat2, OP_CHMOD, args->dfd, args->filename)
#endif
PATH_PROBE(chown, OP_CHOWN, -100, args->filename)
PATH_PROBE(lchown, OP_CHOWN, -100, args->filename)
PATH_PROBE(fchownat, OP_CHOWN, args->dfd, args->filename)
PATH_PROBE(setxattr, OP_XATTR, -100, args->pathname)
PATH_PROBE(lsetxattr, OP_XATTR, -100, args->pathname)
PATH_PROBE(removexattr, OP_XATTR, -100, args->pathname)
PATH_PROBE(lremovexattr, OP_XATTR, -100, args->pathname)
#ifdef HAVE_setxattrat
PATH_PROBE(setxattrat, OP_XATTR, args->dfd, args->pathname)
#endif
#ifdef HAVE_removexattrat
PATH_PROBE(removexattrat, OP_XATTR, args->dfd, args->pathname)
#endif
PATH_PROBE(utimes, OP_UTIMES, -100, args->filename)
#ifdef HAVE_utime
PATH_PROBE(utime, OP_UTIMES, -100, args->filename)
#endif
#ifdef HAVE_futimesat
PATH_PROBE(futimesat, OP_UTIMES, args->dfd, args->filename)
#endif
PATH2_PROBE(rename, OP_RENAME, -100, args->oldname, -100, args->newname)
PATH2_PROBE(renameat, OP_RENAME, args->olddfd, args->oldname, args->newdfd, args->newname)
PATH2_PROBE(renameat2, OP_RENAME, args->olddfd, args->oldname, args->newdfd, args->newname)
PATH2_PROBE(link, OP_LINK, -100, args->oldname, -100, args->newname)
PATH2_PROBE(linkat, OP_LINK, args->olddfd, args->oldname, args->newdfd, args->newname)
/* symlink's first argument is the link's content, not a path to resolve. */
PATH2_PROBE(symlink, OP_SYMLINK, -100, args->oldname, -100, args->newname)
PATH2_PROBE(symlinkat, OP_SYMLINK, -100, args->oldname, args->newdfd, args->newname)

/* --- what changes the tmpfs and mqueue mounts without writing a file ------------------- */

static __always_inline int on_tmpfs_only(void) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
    mark(slot, MARK_TMPFS);
    remember(slot, IN_MARK, M_TMPFS);
    return 0;
}

/* Entry and exit of a syscall that may change what the tmpfs fingerprint covers. */
#define TMPFS_PROBE(name)                                                                  \
    TRACEPOINT_PROBE(syscalls, sys_enter_##name) { return on_tmpfs_only(); }                \
    TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return on_exit(args->ret); }

/* The mount table: a tmpfs with content mounted or unmounted changes the fingerprint. */
TMPFS_PROBE(mount)
TMPFS_PROBE(umount)
TMPFS_PROBE(pivot_root)
#ifdef HAVE_move_mount
TMPFS_PROBE(move_mount)
#endif
#ifdef HAVE_fsmount
TMPFS_PROBE(fsmount)
#endif
#ifdef HAVE_mount_setattr
TMPFS_PROBE(mount_setattr)
#endif
#ifdef HAVE_open_tree
TMPFS_PROBE(open_tree)
#endif
#ifdef HAVE_open_tree_attr
TMPFS_PROBE(open_tree_attr)
#endif
/* POSIX message queues change their mqueue file (times, and what a read of it shows) by calls
 * that write no file: a send, a receive, a notification request, new attributes. */
TMPFS_PROBE(mq_open)
TMPFS_PROBE(mq_unlink)
TMPFS_PROBE(mq_timedsend)
TMPFS_PROBE(mq_timedreceive)
TMPFS_PROBE(mq_notify)
TMPFS_PROBE(mq_getsetattr)

/* --- fd-based mutations ----------------------------------------------------------------- */

/* A mutation through `fd`: marked now if the fd's file is not quiet, and again at a successful exit. */
static __always_inline int on_fd(u32 op, int fd, u64 flags) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
    int c = classify(fd_file(fd));
    if (c == CLASS_QUIET)
        return 0;
    if (c == CLASS_TMPFS) {
        /* Fingerprinted again at the turn end (mounts.py); nothing to explain. */
        mark(slot, MARK_TMPFS);
        remember(slot, IN_MARK, M_TMPFS);
        return 0;
    }
    if (c == CLASS_PROC) {
        mark(slot, MARK_PROC);
        struct event *u = start(slot, EV_UNCERTAIN, OP_PROC_WRITE);
        if (u) {
            u->fd = fd;
            events.ringbuf_submit(u, 0);
        }
        return 0;
    }
    mark(slot, MARK_FILES);
    remember(slot, IN_MARK, M_FILES);
    if (op == OP_WRITE) {
        /* Writes come in floods: one explanation per (process, fd) per epoch. */
        struct counts *c = counts.lookup(&slot);
        if (!c || spent(slot, c))
            return 0;
        struct epoch *ep = epochs.lookup(&slot);
        u64 epoch = ep ? ep->number : 0;
        struct wkey k = {.tgid = bpf_get_current_pid_tgid() >> 32, .fd = fd};
        u64 *seen = wseen.lookup(&k);
        if (seen && *seen == epoch)
            return 0;
        wseen.update(&k, &epoch);
    }
    struct event *e = start(slot, EV_FD, op);
    if (!e)
        return 0;
    e->fd = fd;
    e->flags = flags;
    events.ringbuf_submit(e, 0);
    return 0;
}

#define FD_PROBE(name, op, fd)                                                      \
    TRACEPOINT_PROBE(syscalls, sys_enter_##name) { return on_fd(op, fd, 0); }        \
    TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return on_exit(args->ret); }

FD_PROBE(write, OP_WRITE, args->fd)
FD_PROBE(pwrite64, OP_WRITE, args->fd)
FD_PROBE(writev, OP_WRITE, args->fd)
FD_PROBE(pwritev, OP_WRITE, args->fd)
#ifdef HAVE_pwritev2
FD_PROBE(pwritev2, OP_WRITE, args->fd)
#endif
FD_PROBE(ftruncate, OP_TRUNCATE, args->fd)
FD_PROBE(fallocate, OP_FALLOCATE, args->fd)
FD_PROBE(fchmod, OP_CHMOD, args->fd)
FD_PROBE(fchown, OP_CHOWN, args->fd)
FD_PROBE(fsetxattr, OP_XATTR, args->fd)
FD_PROBE(fremovexattr, OP_XATTR, args->fd)
FD_PROBE(copy_file_range, OP_COPY, args->fd_out)
FD_PROBE(sendfile64, OP_COPY, args->out_fd)
FD_PROBE(splice, OP_COPY, args->fd_out)
/* FICLONE, FS_IOC_SETFLAGS, ... change files; a terminal's ioctls are quiet (a character device). */
FD_PROBE(ioctl, OP_IOCTL, args->fd)

/* utimensat(dfd, NULL, ...) changes the file dfd refers to; with a path it is path-based. */
TRACEPOINT_PROBE(syscalls, sys_enter_utimensat) {
    if (!args->filename)
        return on_fd(OP_UTIMES, args->dfd, 0);
    return on_path(OP_UTIMES, args->dfd, args->filename);
}
TRACEPOINT_PROBE(syscalls, sys_exit_utimensat) { return on_exit(args->ret); }

/* A shared mapping of a file open for writing: writes through it need no syscall at all, and
 * mprotect can make a read-only one writable later.  userspace also treats a sandbox that
 * holds such a mapping at a turn end as changing its files in the next turn (inspector/procs.py). */
TRACEPOINT_PROBE(syscalls, sys_enter_mmap) {
    /* MAP_SHARED = 1, MAP_SHARED_VALIDATE = 3 */
    if (!(args->flags & 1) || (long)args->fd < 0)
        return 0;
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
    void *file = fd_file((int)args->fd);
    u32 fmode = FMODE_WRITE_BIT;   /* unreadable: assume writable */
    if (file)
        bpf_probe_read_kernel(&fmode, sizeof(fmode), (char *)file + OFF_FILE_MODE);
    if (!(fmode & FMODE_WRITE_BIT))
        return 0;
    return on_fd(OP_MMAP, args->fd, ((u64)args->flags << 32) | args->prot);
}
TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { return on_exit(args->ret); }

/* --- what the probes cannot follow ---------------------------------------------------------- */

static __always_inline int uncertain(u32 op) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
    mark(slot, MARK_PROC);
    mark(slot, MARK_FILES);
    mark(slot, MARK_TMPFS);
    struct event *e = start(slot, EV_UNCERTAIN, op);
    if (!e)
        return 0;
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_ptrace) {
    if (args->request == 0)   /* PTRACE_TRACEME changes only the caller */
        return 0;
    return uncertain(OP_PTRACE);
}
TRACEPOINT_PROBE(syscalls, sys_enter_process_vm_writev) { return uncertain(OP_VM_WRITE); }
TRACEPOINT_PROBE(syscalls, sys_enter_io_uring_setup) { return uncertain(OP_IO_URING); }
TRACEPOINT_PROBE(syscalls, sys_enter_io_uring_enter) { return uncertain(OP_IO_URING); }
TRACEPOINT_PROBE(syscalls, sys_enter_io_uring_register) { return uncertain(OP_IO_URING); }
TRACEPOINT_PROBE(syscalls, sys_enter_io_setup) { return uncertain(OP_AIO); }
TRACEPOINT_PROBE(syscalls, sys_enter_io_submit) { return uncertain(OP_AIO); }
TRACEPOINT_PROBE(syscalls, sys_enter_open_by_handle_at) {
    if (!(args->flags & WRITE_FLAGS))
        return 0;
    return uncertain(OP_BY_HANDLE);
}

/* --- process lifecycle -------------------------------------------------------------------------- */

/* Forks and exits are counted, not sent: the decision reads processes from
 * /proc, and a build forks thousands of times. */
static __always_inline void count(u32 slot, u32 what) {
    struct counts *c = counts.lookup(&slot);
    if (!c)
        return;
    if (what == 0)
        __sync_fetch_and_add(&c->forks, 1);
    else if (what == 1)
        __sync_fetch_and_add(&c->exits, 1);
    else
        __sync_fetch_and_add(&c->task_exits, 1);
}

TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 slot;
    if (sandbox_slot(&slot))
        count(slot, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
    struct event *e = start(slot, EV_EXEC, 0);
    if (!e)
        return 0;
    TP_DATA_LOC_READ_STR(e->path, filename, sizeof(e->path));
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u32 slot;
    u64 id = bpf_get_current_pid_tgid();
    if (!sandbox_slot(&slot))
        return 0;
    /* A core dump is written by the kernel, through no syscall: exit_code has 0x80 (WCOREFLAG). */
    int code = 0;
    bpf_probe_read_kernel(&code, sizeof(code), (char *)bpf_get_current_task() + OFF_TASK_EXIT_CODE);
    if (code & 0x80) {
        mark(slot, MARK_FILES);
        mark(slot, MARK_TMPFS);   /* the core may be written to a tmpfs */
        struct event *e = start(slot, EV_EXIT, OP_CORE);
        if (e)
            events.ringbuf_submit(e, 0);
    }
    if ((u32)id == (u32)(id >> 32))   /* the process, not each thread */
        count(slot, 1);
    count(slot, 2);   /* every task: the decision's "no new task lives on" (inspector/vouched.py) */
    return 0;
}
