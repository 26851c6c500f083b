/*
 * crab's inspector probes: what a sandbox's processes do to files and to each other.
 *
 * Loaded by crabd with bcc (crabd/inspector/bpf.py), through tracepoints only:
 * this kernel has no kprobes.  One set of programs serves every sandbox on the
 * host.  An event belongs to a sandbox when the cgroup of the calling task at
 * level SANDBOX_CGROUP_LEVEL (cgroup v2; Docker puts a container at
 * /docker/<id>, level 2) is a key of `sandboxes`; processes in child cgroups of
 * a sandbox are attributed to it through the same ancestor.  Everything else
 * returns at once.
 *
 * Parameters come in through cflags (never by editing this text):
 *   SANDBOX_CGROUP_LEVEL  the cgroup level of a sandbox (default 2)
 *   MAX_SANDBOXES         slots in the per-sandbox maps
 *   PATH_BYTES            bytes kept of each path (see below)
 *   RINGBUF_PAGES         size of the event ring buffer, in pages (a power of two)
 *   EVENT_BUDGET          events sent per sandbox per epoch; past it only counted
 *   HAVE_<syscall>        the syscall's tracepoint exists on this kernel
 *
 * Paths: each path argument is copied into a PATH_BYTES buffer.  A longer
 * path is cut and flagged (F_PATH1_CUT / F_PATH2_CUT); userspace then cannot
 * trust it and falls back to scanning the sandbox's files (sound, slower).
 *
 * Events go to one ring buffer.  When it is full, the event is counted in
 * `dropped[slot]`; userspace treats a sandbox with dropped events as
 * uncertain (it scans instead of trusting the events).
 *
 * The write family fires constantly; it is reported once per (process, fd)
 * per epoch (userspace bumps `epochs[slot]` at every turn decision), which
 * bounds the events of a turn by the distinct descriptors written.
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
#define EV_FD        4   /* an fd-based mutation: fd, op */
#define EV_FORK      5   /* (unused: forks and exits are counted in `lifecycle`) */
#define EV_EXEC      6   /* path = filename */
#define EV_EXIT      7
#define EV_UNCERTAIN 8   /* op says why: ptrace, process_vm_writev, io_uring, aio, open_by_handle */

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

BPF_HASH(sandboxes, u64, u32, MAX_SANDBOXES);        /* cgroup id -> slot */
BPF_ARRAY(epochs, u64, MAX_SANDBOXES);               /* slot -> epoch */
BPF_ARRAY(dropped, u64, MAX_SANDBOXES);              /* slot -> events lost */
BPF_ARRAY(budget, u64, MAX_SANDBOXES);               /* slot -> events this epoch (sent or not) */
BPF_ARRAY(lifecycle, u64, MAX_SANDBOXES * 2);        /* slot*2 -> forks, slot*2+1 -> exits */
BPF_TABLE("lru_hash", struct wkey, u64, wseen, 65536);   /* (tgid, fd) -> epoch last reported */
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);           /* default 1024 pages: 4 MiB */

static __always_inline int sandbox_slot(u32 *slot) {
    u64 cg = bpf_get_current_ancestor_cgroup_id(SANDBOX_CGROUP_LEVEL);
    u32 *s = sandboxes.lookup(&cg);
    if (!s)
        return 0;
    *slot = *s;
    return 1;
}

static __always_inline void lost(u32 slot) {
    u64 *n = dropped.lookup(&slot);
    if (n)
        __sync_fetch_and_add(n, 1);
}

static __always_inline struct event *start(u32 slot, u32 kind, u32 op) {
    /* A turn needs its first few events (one mutation makes its files
     * "dirty"; a few more explain it).  Past EVENT_BUDGET in one epoch only a
     * count is kept, and userspace treats the turn as dirty: the cost of a
     * busy build stays in the kernel, not in crabd. */
    if (kind != EV_UNCERTAIN) {
        u64 *b = budget.lookup(&slot);
        if (!b)
            return 0;
        if (*b >= EVENT_BUDGET) {
            __sync_fetch_and_add(b, 1);
            return 0;
        }
        __sync_fetch_and_add(b, 1);
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

/* --- opens for writing -------------------------------------------------------- */

#define WRITE_FLAGS (01 | 02 | 0100 | 01000)   /* O_WRONLY | O_RDWR | O_CREAT | O_TRUNC */

static __always_inline int on_open(int dfd, const char *filename, u64 flags) {
    u32 slot;
    if (!(flags & WRITE_FLAGS) || !sandbox_slot(&slot))
        return 0;
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
#ifdef HAVE_openat2
TRACEPOINT_PROBE(syscalls, sys_enter_openat2) {
    struct { u64 flags; u64 mode; u64 resolve; } how = {};
    bpf_probe_read_user(&how, sizeof(how), args->how);
    return on_open(args->dfd, args->filename, how.flags);
}
#endif

/* --- path-based mutations --------------------------------------------------------- */

static __always_inline int on_path(u32 op, int dfd, const char *p) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
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

TRACEPOINT_PROBE(syscalls, sys_enter_truncate) { return on_path(OP_TRUNCATE, -100, args->path); }
TRACEPOINT_PROBE(syscalls, sys_enter_unlink) { return on_path(OP_UNLINK, -100, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_unlinkat) { return on_path(OP_UNLINK, args->dfd, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_mkdir) { return on_path(OP_MKDIR, -100, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_mkdirat) { return on_path(OP_MKDIR, args->dfd, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_rmdir) { return on_path(OP_RMDIR, -100, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_mknod) { return on_path(OP_MKNOD, -100, args->filename); }
TRACEPOINT_PROBE(syscalls, sys_enter_mknodat) { return on_path(OP_MKNOD, args->dfd, args->filename); }
TRACEPOINT_PROBE(syscalls, sys_enter_chmod) { return on_path(OP_CHMOD, -100, args->filename); }
TRACEPOINT_PROBE(syscalls, sys_enter_fchmodat) { return on_path(OP_CHMOD, args->dfd, args->filename); }
#ifdef HAVE_fchmodat2
TRACEPOINT_PROBE(syscalls, sys_enter_fchmodat2) { return on_path(OP_CHMOD, args->dfd, args->filename); }
#endif
TRACEPOINT_PROBE(syscalls, sys_enter_chown) { return on_path(OP_CHOWN, -100, args->filename); }
TRACEPOINT_PROBE(syscalls, sys_enter_lchown) { return on_path(OP_CHOWN, -100, args->filename); }
TRACEPOINT_PROBE(syscalls, sys_enter_fchownat) { return on_path(OP_CHOWN, args->dfd, args->filename); }
TRACEPOINT_PROBE(syscalls, sys_enter_setxattr) { return on_path(OP_XATTR, -100, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_lsetxattr) { return on_path(OP_XATTR, -100, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_removexattr) { return on_path(OP_XATTR, -100, args->pathname); }
TRACEPOINT_PROBE(syscalls, sys_enter_lremovexattr) { return on_path(OP_XATTR, -100, args->pathname); }
#ifdef HAVE_setxattrat
TRACEPOINT_PROBE(syscalls, sys_enter_setxattrat) { return on_path(OP_XATTR, args->dfd, args->pathname); }
#endif
#ifdef HAVE_removexattrat
TRACEPOINT_PROBE(syscalls, sys_enter_removexattrat) { return on_path(OP_XATTR, args->dfd, args->pathname); }
#endif
TRACEPOINT_PROBE(syscalls, sys_enter_utimes) { return on_path(OP_UTIMES, -100, args->filename); }
#ifdef HAVE_utime
TRACEPOINT_PROBE(syscalls, sys_enter_utime) { return on_path(OP_UTIMES, -100, args->filename); }
#endif
#ifdef HAVE_futimesat
TRACEPOINT_PROBE(syscalls, sys_enter_futimesat) { return on_path(OP_UTIMES, args->dfd, args->filename); }
#endif

/* utimensat(dfd, NULL, ...) changes the file dfd refers to: an fd-based event. */
static __always_inline int on_fd(u32 op, int fd, u64 flags);
TRACEPOINT_PROBE(syscalls, sys_enter_utimensat) {
    if (!args->filename)
        return on_fd(OP_UTIMES, args->dfd, 0);
    return on_path(OP_UTIMES, args->dfd, args->filename);
}

TRACEPOINT_PROBE(syscalls, sys_enter_rename) { return on_path2(OP_RENAME, -100, args->oldname, -100, args->newname); }
TRACEPOINT_PROBE(syscalls, sys_enter_renameat) {
    return on_path2(OP_RENAME, args->olddfd, args->oldname, args->newdfd, args->newname);
}
TRACEPOINT_PROBE(syscalls, sys_enter_renameat2) {
    return on_path2(OP_RENAME, args->olddfd, args->oldname, args->newdfd, args->newname);
}
TRACEPOINT_PROBE(syscalls, sys_enter_link) { return on_path2(OP_LINK, -100, args->oldname, -100, args->newname); }
TRACEPOINT_PROBE(syscalls, sys_enter_linkat) {
    return on_path2(OP_LINK, args->olddfd, args->oldname, args->newdfd, args->newname);
}
/* symlink's first argument is the link's content, not a path to resolve. */
TRACEPOINT_PROBE(syscalls, sys_enter_symlink) { return on_path2(OP_SYMLINK, -100, args->oldname, -100, args->newname); }
TRACEPOINT_PROBE(syscalls, sys_enter_symlinkat) {
    return on_path2(OP_SYMLINK, -100, args->oldname, args->newdfd, args->newname);
}

/* --- fd-based mutations ----------------------------------------------------------------- */

static __always_inline int on_fd(u32 op, int fd, u64 flags) {
    u32 slot;
    if (fd < 0 || !sandbox_slot(&slot))
        return 0;
    struct event *e = start(slot, EV_FD, op);
    if (!e)
        return 0;
    e->fd = fd;
    e->flags = flags;
    events.ringbuf_submit(e, 0);
    return 0;
}

/* Once per (process, fd) per epoch: writes come in floods. */
static __always_inline int on_write(int fd) {
    u32 slot;
    if (fd < 0 || !sandbox_slot(&slot))
        return 0;
    /* A plain write never decides a turn (files held open for writing are
     * checked at turn end); past the budget it is not worth the LRU update. */
    u64 *b = budget.lookup(&slot);
    if (!b || *b >= EVENT_BUDGET)
        return 0;
    u64 *ep = epochs.lookup(&slot);
    u64 epoch = ep ? *ep : 0;
    struct wkey k = {.tgid = bpf_get_current_pid_tgid() >> 32, .fd = fd};
    u64 *seen = wseen.lookup(&k);
    if (seen && *seen == epoch)
        return 0;
    wseen.update(&k, &epoch);
    struct event *e = start(slot, EV_FD, OP_WRITE);
    if (!e)
        return 0;
    e->fd = fd;
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_write) { return on_write(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwrite64) { return on_write(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return on_write(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev) { return on_write(args->fd); }
#ifdef HAVE_pwritev2
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev2) { return on_write(args->fd); }
#endif
TRACEPOINT_PROBE(syscalls, sys_enter_ftruncate) { return on_fd(OP_TRUNCATE, args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_fallocate) { return on_fd(OP_FALLOCATE, args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_fchmod) { return on_fd(OP_CHMOD, args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_fchown) { return on_fd(OP_CHOWN, args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_fsetxattr) { return on_fd(OP_XATTR, args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_fremovexattr) { return on_fd(OP_XATTR, args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_copy_file_range) { return on_fd(OP_COPY, args->fd_out, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendfile64) { return on_fd(OP_COPY, args->out_fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_splice) { return on_fd(OP_COPY, args->fd_out, 0); }

/* A writable shared mapping of a file: writes through it need no syscall at all. */
TRACEPOINT_PROBE(syscalls, sys_enter_mmap) {
    /* PROT_WRITE = 2, MAP_SHARED = 1, MAP_SHARED_VALIDATE = 3 */
    if (!(args->prot & 2) || !(args->flags & 1) || (long)args->fd < 0)
        return 0;
    return on_fd(OP_MMAP, args->fd, ((u64)args->flags << 32) | args->prot);
}

/* --- what the probes cannot follow ---------------------------------------------------------- */

static __always_inline int uncertain(u32 op) {
    u32 slot;
    if (!sandbox_slot(&slot))
        return 0;
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
    u32 k = slot * 2 + what;
    u64 *n = lifecycle.lookup(&k);
    if (n)
        __sync_fetch_and_add(n, 1);
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
    if ((u32)id != (u32)(id >> 32) || !sandbox_slot(&slot))   /* the process, not each thread */
        return 0;
    count(slot, 1);
    return 0;
}
