/*
 * crab-init: PID 1 of every crab sandbox (or the only child of its keeper, see "PID 1 keeper").
 *
 * crabd never uses `docker exec`: CRIU dumps only the process tree under the
 * container's PID 1, so anything started from outside would vanish on
 * restore.  Instead crabd asks this program to spawn every command and the
 * persistent shell session, so every process descends from PID 1.
 *
 * It listens on an ABSTRACT unix stream socket ("\0crab-init", or
 * $CRAB_INIT_SOCKET).  Abstract names live in the container's network
 * namespace; there is no file on the host a hostile sandbox could replace
 * with a symlink.  But every process INSIDE the sandbox shares that network
 * namespace and could connect too, so:
 *
 * Who may connect: only crabd.  crabd connects from the host's pid
 * namespace, which is an ancestor of the sandbox's; a process of an
 * ancestor namespace has no pid in ours, so SO_PEERCRED (translated by the
 * kernel into the reader's pid namespace) reports pid 0 for crabd.  Every
 * process inside the sandbox, including one in a pid namespace it created
 * (a descendant of ours, so its processes have pids here too), gets a
 * nonzero pid, whatever its uid or capabilities; pid namespaces can only be
 * entered downwards (setns refuses an ancestor), and the peer pid is
 * recorded at connect() time, so neither a dead connector nor a passed fd
 * turns into pid 0.  Any connection whose peer pid is not 0 is closed at
 * once, before a byte of it is read, and counted (HELLO_OK reports the
 * count).  There is no switch to relax this: tests run this binary as PID 1
 * of a fresh pid namespace (`unshare --pid --fork`) like a sandbox does.
 *
 * Nobody in the sandbox may read or steer this process: it makes itself
 * non-dumpable (PR_SET_DUMPABLE 0), so ptrace, /proc/1/mem, /proc/1/fd and
 * pidfd_getfd need CAP_SYS_PTRACE, which Docker's default capability set
 * does not grant to root in a container.  (Children get a fresh dumpable
 * flag from execve; CRIU, as root on the host, dumps and restores us as
 * before, including the flag.)
 *
 * The session's control channel.  A persistent process spawned with
 * F_CONTROL (the session's bash) gets one end of a unix socketpair as fd
 * CTL_FD (100); init keeps the other end with SO_PASSCRED set, so each
 * message read from it carries its sender's pid (SCM_CREDENTIALS, filled in
 * by the kernel from the sending task, translated into our namespace; only
 * CAP_SYS_ADMIN over our pid namespace could claim another pid, and a
 * stream socket never glues bytes of different senders into one read).
 * Only bytes sent by that very process (pid == the child's pid, which
 * cannot be reused while we have not reaped it) are accepted; anything a
 * child or another process sends through a copy of the fd (an inherited
 * one, pidfd_getfd) is dropped and counted (CONTROL_REJECTED, LIST).  crab's
 * session wrapper closes CTL_FD for the user's command and writes its done
 * marker and state captures there with bash builtins (no fork), so
 * command completion and captured state cannot be forged by what a
 * command prints (see crabd/runtime/session_proto.py).  Order: when
 * accepted control bytes arrive, the bytes then waiting in the child's
 * stdout/stderr pipes (FIONREAD) were written before them; those are
 * relayed first, then the CONTROL frame, and the pipes are not read further
 * meanwhile, so a command's output always precedes its done marker.  While
 * no client is attached the channel is not read: the kernel's socket buffer
 * holds what the session wrote (bash blocks once it is full).
 *
 * PID 1 keeper (`crab-init --keeper`, user-namespaced runc sandboxes).
 * CRIU dumps a user-namespaced tree only if, from INSIDE that user
 * namespace, it may open the root task's /proc/<pid>/ns files (its check that
 * every namespace belongs to the target user namespace).  A non-dumpable
 * task passes that ptrace check only for callers with CAP_SYS_PTRACE over
 * its mm's user namespace.  A freshly started init's mm belongs to the
 * sandbox's user namespace (execve put it there), but a RESTORED one's
 * belongs to the host's (CRIU forked it, and only execve moves an mm), so a
 * restored sandbox could never be dumped again.  With --keeper, PID 1 is a
 * tiny dumpable process that forks crab-init proper (its only child,
 * non-dumpable as always), reaps orphans (they come to PID 1, not to
 * crab-init: CRIU restores an orphan whose session leader died only as a
 * child of the root task), forwards TERM, INT and HUP to crab-init and
 * exits with its status.  The keeper holds nothing: no
 * fd but /dev/null on 0-2, no connection, no state; root in the sandbox may
 * ptrace it and gains nothing it lacks.  The price: crab-init, no longer
 * PID 1, can be killed from inside (`kill -9 -1`); the keeper then exits and
 * crabd sees the sandbox die (docs/runc.md "User namespaces").
 *
 * Host-side hook (`crab-init --lo-up`, never inside a sandbox).  A
 * user-namespaced runc sandbox is restored into an empty network namespace
 * made by CRIU, `lo` down, and an established loopback TCP connection cannot
 * be put back without a route.  runc runs the bundle's prestart hooks at
 * CRIU's "setup-namespaces" step, before the sockets, with runc's state JSON
 * on stdin; in this mode crab-init reads the restored root task's pid from
 * it, enters that process's network namespace and sets `lo` up, then exits.
 * A static binary starts in well under a millisecond; the Python hook it
 * replaces took ~26 ms of CPU per restore (docs/benchmarks.md).  The state
 * is runc's, made of crab's own ids and paths: nothing in it comes from the
 * sandbox; it is read bounded all the same and its pid checked.
 *
 * One single-threaded poll() loop; every fd non-blocking; memory bounded:
 * output waiting for a client is capped per connection (backpressure stops
 * reading the child's pipe), a detached persistent process's output goes to
 * a 1 MiB ring per stream that drops the oldest bytes.
 *
 * Wire format (both directions), integers big-endian:
 *   frame := u32 len (type + payload) | u8 type | payload
 *   str   := u32 n | n bytes
 * Client -> init:
 *   0x01 HELLO
 *   0x02 SPAWN  u32 flags, u32 uid, u32 gid, str name, str cwd,
 *               u32 argc, str*argc, u32 envc, str*envc [, u32 rows, u32 cols]
 *               flags: 1 MERGE_STDERR, 2 PERSISTENT, 4 STDIN_NULL,
 *                      8 CONTROL (control channel on fd 100),
 *                      16 PTY (stdout and stderr: one pseudo-terminal, see
 *                      "Pseudo-terminals"; rows and cols its size, 24x80
 *                      if absent); others: EINVAL
 *   0x03 STDIN data   0x04 STDIN_CLOSE   0x05 SIGNAL u32 signo
 *   0x06 ATTACH str name   0x07 DETACH   0x08 LIST   0x09 FORGET str name
 * Init -> client:
 *   0x81 HELLO_OK u32 version, u32 pid, u64 refused_peers, u32 connections
 *        (connections: open client connections, the asking one included;
 *        crabd waits for it to be 1 before a process dump, and an init
 *        older than this field sends 16 bytes)
 *   0x82 STARTED u32 pid, u32 handle
 *   0x83 STDOUT data   0x84 STDERR data   0x85 EXIT i32 wait status
 *   0x86 ATTACHED u32 pid, u32 handle, u64 dropped_out, u64 dropped_err
 *   0x87 DETACHED
 *   0x88 LIST u32 n, n * (str name, u32 pid, u32 handle, u8 alive,
 *                          i32 status, u8 attached, u64 ctl_rejected),
 *             then n * (u8 pty, u16 rows, u16 cols) in the same order
 *             (protocol 3; an older init ends after the entries)
 *   0x89 CONTROL data: bytes the process itself wrote to its control fd
 *   0x8A CONTROL_REJECTED u32 count, u32 pid: messages on the control fd
 *        from other processes (pid: the last one), dropped since the last
 *        report
 *   0x8F ERROR u32 errno, str message
 */
/*
 * Pseudo-terminals (SPAWN flag PTY, protocol 3).  Some programs behave only
 * on a terminal (colour, progress, line buffering, `tty`), so a session may
 * have one: init opens a pty pair in the sandbox's own devpts (the
 * container's /dev/ptmx), keeps the master as the process's only output
 * stream and gives the slave to the child as stdout, stderr and controlling
 * terminal (one interleaved stream, like a terminal shows it).  stdin stays
 * a pipe: crabd writes the session's commands there, and a bash reading its
 * script from a pipe stays non-interactive (no prompt, no echo, no
 * readline).  The slave is put in raw mode (no echo, no signal characters,
 * no output processing): output bytes arrive exactly as written, "\n" not
 * turned into "\r\n".
 *
 * Ordering with the control channel: a write to the slave returns once the
 * bytes are in the tty's buffer, but they reach the master's read side from
 * a kernel worker, so FIONREAD on the master (what is owed before a done
 * marker, for pipes) may not count them yet.  A read(2) of the master that
 * finds nothing first waits for that worker (n_tty_read flushes the buffer
 * work before it reports EAGAIN), so when control bytes arrive init reads
 * the master until EAGAIN and relays all of it before them (at most
 * PTY_SETTLE bytes, so a process flooding the terminal cannot hold init
 * there; beyond that, as for pipes, some output may follow the marker).
 * EIO from the master means every slave descriptor is closed: end of
 * stream, like EOF on a pipe.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define PROTO_VERSION 3
#define MAX_FRAME ((1u << 20) + 64)
#define OUT_CAP (256u * 1024)
#define RING_CAP (1u << 20)
#define STDIN_CAP (1u << 20)
#define CHUNK (64u * 1024)
#define POST_EXIT_DRAIN (4u << 20)
#define MAX_CONNS 256
#define MAX_PROCS 1024
#define PTY_SETTLE (256u * 1024) /* most bytes read from a pty before relaying control bytes */
#define CTL_FD 100              /* the control fd in the child; session_proto.CONTROL_FD */
#define CTL_BATCH 64            /* control messages read per wakeup at most */

enum { T_HELLO = 1, T_SPAWN, T_STDIN, T_STDIN_CLOSE, T_SIGNAL, T_ATTACH, T_DETACH, T_LIST, T_FORGET };
enum { R_HELLO = 0x81, R_STARTED, R_STDOUT, R_STDERR, R_EXIT, R_ATTACHED, R_DETACHED, R_LIST, R_CONTROL,
       R_CONTROL_REJECTED, R_ERROR = 0x8F };
enum { F_MERGE = 1, F_PERSISTENT = 2, F_STDIN_NULL = 4, F_CONTROL = 8, F_PTY = 16, F_ALL = 31 };

struct buf {
    unsigned char *p;
    size_t len, cap;
};

struct ring {
    unsigned char *p;
    size_t head, len; /* head: index of oldest byte */
    uint64_t dropped;
};

struct proc {
    int used;
    uint32_t handle;
    pid_t pid;
    char *name;
    int persistent;
    int fd[2];       /* stdout, stderr read ends; -1 when closed (a pty: fd[0] its master, fd[1] -1) */
    int pty;         /* fd[0] is a pty master */
    int in_fd;       /* stdin write end, -1 when closed */
    struct buf in;   /* bytes waiting for the child's stdin */
    int in_close;    /* close stdin once `in` drains */
    int exited, status, finalized;
    size_t drained;  /* bytes read after exit */
    int conn;        /* attached connection, -1 if none */
    struct ring ring[2];
    int ctl_fd;      /* our end of the control socketpair, -1 if none */
    struct buf ctl;  /* accepted control bytes not yet relayed */
    size_t owe[2];   /* output bytes to relay before `ctl` (written before it) */
    uint64_t ctl_rejected;  /* control messages from other processes, dropped */
    uint32_t rej_unreported;
    pid_t rej_pid;   /* the last process whose message was dropped */
};

struct conn {
    int used, fd;
    struct buf r, w;
    int proc; /* bound process, -1 if none */
    int closing;
};

static struct proc procs[MAX_PROCS];
static struct conn conns[MAX_CONNS];
static uint32_t next_handle = 1;
static int listen_fd = -1, sig_fd = -1;
static uint64_t refused_peers; /* connections from inside the sandbox, closed unread */
static int is_pid1;
static int terminating;
static struct timespec term_deadline;

static void die(const char *what) {
    fprintf(stderr, "crab-init: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) die("out of memory");
    return q;
}

static void buf_put(struct buf *b, const void *d, size_t n) {
    if (b->len + n > b->cap) {
        size_t c = b->cap ? b->cap : 4096;
        while (c < b->len + n) c *= 2;
        b->p = xrealloc(b->p, c);
        b->cap = c;
    }
    memcpy(b->p + b->len, d, n);
    b->len += n;
}

static void buf_consume(struct buf *b, size_t n) {
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
    /* Give memory back after a burst: buffers must not stay huge forever. */
    if (b->cap > (1u << 20) && b->len < b->cap / 4) {
        b->cap = b->len > 4096 ? b->len : 4096;
        b->p = xrealloc(b->p, b->cap);
    }
}

static void buf_free(struct buf *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

static void ring_put(struct ring *r, const unsigned char *d, size_t n) {
    if (!r->p) r->p = xrealloc(NULL, RING_CAP);
    if (n > RING_CAP) {
        r->dropped += n - RING_CAP;
        d += n - RING_CAP;
        n = RING_CAP;
    }
    size_t over = r->len + n > RING_CAP ? r->len + n - RING_CAP : 0;
    r->head = (r->head + over) % RING_CAP;
    r->len -= over;
    r->dropped += over;
    for (size_t i = 0; i < n; i++) r->p[(r->head + r->len + i) % RING_CAP] = d[i];
    r->len += n;
}

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void send_frame(int ci, int type, const void *payload, size_t n) {
    unsigned char h[5];
    put_u32(h, (uint32_t)(n + 1));
    h[4] = (unsigned char)type;
    buf_put(&conns[ci].w, h, 5);
    if (n) buf_put(&conns[ci].w, payload, n);
}

static void send_error(int ci, int err, const char *msg) {
    struct buf b = {0};
    unsigned char v[4];
    put_u32(v, (uint32_t)err);
    buf_put(&b, v, 4);
    put_u32(v, (uint32_t)strlen(msg));
    buf_put(&b, v, 4);
    buf_put(&b, msg, strlen(msg));
    send_frame(ci, R_ERROR, b.p, b.len);
    buf_free(&b);
}

static void set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* --- processes ----------------------------------------------------------- */

static int find_proc_pid(pid_t pid) {
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i].used && procs[i].pid == pid && !procs[i].exited) return i;
    return -1;
}

static int find_proc_name(const char *name) {
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i].used && procs[i].persistent && procs[i].name && strcmp(procs[i].name, name) == 0) return i;
    return -1;
}

static void free_proc(int pi) {
    struct proc *p = &procs[pi];
    close_fd(&p->fd[0]);
    close_fd(&p->fd[1]);
    close_fd(&p->in_fd);
    close_fd(&p->ctl_fd);
    buf_free(&p->in);
    buf_free(&p->ctl);
    free(p->ring[0].p);
    free(p->ring[1].p);
    free(p->name);
    memset(p, 0, sizeof *p);
}

static void send_exit(int ci, int status) {
    unsigned char v[4];
    put_u32(v, (uint32_t)status);
    send_frame(ci, R_EXIT, v, 4);
}

static void put_u64(unsigned char *p, uint64_t v) {
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

/* --- the control channel ------------------------------------------------- */

/* Bytes waiting in a pipe right now. */
static size_t pipe_pending(int fd) {
    int n = 0;
    if (fd < 0 || ioctl(fd, FIONREAD, &n) < 0 || n < 0) return 0;
    return (size_t)n;
}

#ifndef SYS_close_range
#define SYS_close_range 436 /* the same number on every architecture (Linux 5.9) */
#endif

/* Close [lo, hi] (hi inclusive); close_range(2) where the kernel has it. */
static void close_between(unsigned lo, unsigned hi) {
    if (lo > hi) return;
    if (syscall(SYS_close_range, lo, hi, 0) == 0) return;
    /* Before Linux 5.9: one close(2) per number, up to the descriptor limit. */
    struct rlimit rl;
    unsigned top = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 1048576 ? (unsigned)rl.rlim_cur : 1048576;
    for (unsigned fd = lo; fd <= hi && fd < top; fd++) close((int)fd);
}

/* In a new child: close every descriptor from 3 up but keep_a and keep_b
 * (either may be -1).  A close(2) for each of 65,533 numbers, as before,
 * cost ~19 ms of CPU per command run in a sandbox, and the command waited
 * for it: most of a plain command's time. */
static void close_others(int keep_a, int keep_b) {
    int k[2] = {keep_a < keep_b ? keep_a : keep_b, keep_a < keep_b ? keep_b : keep_a};
    unsigned next = 3;
    for (int i = 0; i < 2; i++) {
        if (k[i] < (int)next) continue;
        close_between(next, (unsigned)k[i] - 1);
        next = (unsigned)k[i] + 1;
    }
    close_between(next, ~0u);
}

/* One message from the control socket and the pid of the process that sent
 * it (-1 if the kernel attached no credentials).  Room is left for exactly
 * one SCM_CREDENTIALS: file descriptors someone sends along (SCM_RIGHTS) do
 * not fit and are discarded by the kernel; any that slipped in are closed. */
static ssize_t recv_ctl(int fd, unsigned char *b, size_t n, pid_t *from) {
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(struct ucred))];
    } cm;
    struct iovec iov = {b, n};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.space;
    mh.msg_controllen = sizeof cm.space;
    *from = -1;
    ssize_t r = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r <= 0) return r;
    pid_t pid = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET) continue;
        if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len >= CMSG_LEN(sizeof(struct ucred))) {
            struct ucred uc;
            memcpy(&uc, CMSG_DATA(c), sizeof uc);
            pid = uc.pid;
        } else if (c->cmsg_type == SCM_RIGHTS) {
            size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int f;
                memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
                close(f);
            }
            pid = -1; /* never from our bash: it sends no fds */
            break;
        }
    }
    *from = pid;
    return r;
}

static void send_ctl_bytes(int ci, struct buf *b) {
    for (size_t off = 0; off < b->len; off += CHUNK) {
        size_t n = b->len - off < CHUNK ? b->len - off : CHUNK;
        send_frame(ci, R_CONTROL, b->p + off, n);
    }
    buf_free(b);
}

static void report_rejections(int pi) {
    struct proc *p = &procs[pi];
    if (!p->rej_unreported || p->conn < 0) return;
    unsigned char v[8];
    put_u32(v, p->rej_unreported);
    put_u32(v + 4, (uint32_t)p->rej_pid);
    send_frame(p->conn, R_CONTROL_REJECTED, v, 8);
    p->rej_unreported = 0;
}

/* Read one control message; keep it if the process itself sent it.
 * Returns 1 kept, 0 dropped (another sender), -1 nothing now / closed. */
static int take_ctl(int pi) {
    struct proc *p = &procs[pi];
    unsigned char tmp[CHUNK];
    pid_t from;
    ssize_t n = recv_ctl(p->ctl_fd, tmp, sizeof tmp, &from);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return -1;
    if (n <= 0) {
        /* Every holder closed its end (the process exec'd or closed fd 100):
         * no marker can come any more; the client's timeout deals with it. */
        close_fd(&p->ctl_fd);
        return -1;
    }
    if (from != p->pid) {
        p->ctl_rejected++;
        p->rej_unreported++;
        p->rej_pid = from;
        return 0;
    }
    buf_put(&p->ctl, tmp, (size_t)n);
    return 1;
}

/* The process exited and its pipes are drained: report and unbind. */
static void finalize(int pi) {
    struct proc *p = &procs[pi];
    close_fd(&p->fd[0]);
    close_fd(&p->fd[1]);
    close_fd(&p->in_fd);
    buf_free(&p->in);
    p->finalized = 1;
    if (p->conn >= 0) {
        send_exit(p->conn, p->status);
        conns[p->conn].proc = -1;
        p->conn = -1;
        if (!p->persistent) free_proc(pi);
    } else if (!p->persistent) {
        free_proc(pi); /* nobody is waiting for it */
    }
}

/* Read one chunk from stream s (0 stdout, 1 stderr) of process pi.
 * Returns 1 if data was read, 0 on EAGAIN, -1 on EOF/error (fd closed). */
static int pump_output(int pi, int s) {
    struct proc *p = &procs[pi];
    unsigned char tmp[CHUNK];
    size_t room = CHUNK;
    if (p->conn >= 0) {
        size_t wl = conns[p->conn].w.len;
        if (wl >= OUT_CAP) return 0;
        if (OUT_CAP - wl < room) room = OUT_CAP - wl;
        /* Control bytes wait: relay exactly what was written before them. */
        if (p->ctl.len && p->owe[s] < room) room = p->owe[s];
        if (!room) return 0;
    }
    ssize_t n = read(p->fd[s], tmp, room);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (n <= 0) {
        close_fd(&p->fd[s]);
        p->owe[s] = 0;
        return -1;
    }
    p->owe[s] = p->owe[s] > (size_t)n ? p->owe[s] - (size_t)n : 0;
    if (p->exited) p->drained += (size_t)n;
    if (p->conn >= 0)
        send_frame(p->conn, s == 0 ? R_STDOUT : R_STDERR, tmp, (size_t)n);
    else if (p->persistent)
        ring_put(&p->ring[s], tmp, (size_t)n);
    /* else: a one-shot process whose client left; discard. */
    return 1;
}

/* Relay the pending control bytes once the output written before them is
 * out.  Returns 1 when nothing is pending any more, 0 while it waits (for
 * the client to read, or for a client to attach). */
static int flush_ctl(int pi) {
    struct proc *p = &procs[pi];
    if (!p->ctl.len) return 1;
    if (p->conn < 0) return 0;
    for (int s = 0; s < 2; s++) {
        while (p->owe[s] && p->fd[s] >= 0) {
            if (conns[p->conn].w.len >= OUT_CAP) return 0;
            /* Nothing there although FIONREAD said so: someone else read the
             * pipe (it can be opened through /proc/<pid>/fd); owe no more. */
            if (pump_output(pi, s) == 0) p->owe[s] = 0;
        }
        p->owe[s] = 0;
    }
    send_ctl_bytes(p->conn, &p->ctl);
    return 1;
}

/* Control bytes came from a pty process: relay what its terminal holds now
 * (see "Pseudo-terminals": reading until EAGAIN waits for the tty's buffer
 * worker, so everything written before the control bytes is in).  Called
 * only with a client attached; may pass OUT_CAP by up to PTY_SETTLE. */
static void pty_settle(int pi) {
    struct proc *p = &procs[pi];
    unsigned char tmp[CHUNK];
    for (size_t total = 0; p->fd[0] >= 0 && total < PTY_SETTLE;) {
        ssize_t n = read(p->fd[0], tmp, sizeof tmp);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) break;
        if (n <= 0) { /* EIO: every slave descriptor is closed */
            close_fd(&p->fd[0]);
            break;
        }
        total += (size_t)n;
        send_frame(p->conn, R_STDOUT, tmp, (size_t)n);
    }
    p->owe[0] = p->owe[1] = 0;
}

/* The control socket is readable (we poll it only while a client is
 * attached, has room, and nothing is pending).  Every message already
 * queued is taken into one relay, up to CHUNK bytes: bash writes a state
 * capture as a hundred or more small messages, each of which was a frame
 * for crabd to parse (~60 frames a capture before, ~34 after).  The order still
 * holds: after each message the output owed is what the pipes hold then,
 * which only grows, so everything written before any of the messages is
 * relayed before all of them (as for one message, a little written after
 * may go first too). */
static void read_ctl(int pi) {
    struct proc *p = &procs[pi];
    for (int i = 0; i < CTL_BATCH && p->ctl_fd >= 0 && p->ctl.len < CHUNK; i++) {
        int r = take_ctl(pi);
        if (r < 0) break;
        if (r == 1 && p->pty)
            pty_settle(pi);
        else if (r == 1)
            for (int s = 0; s < 2; s++) p->owe[s] = pipe_pending(p->fd[s]);
    }
    report_rejections(pi);
    flush_ctl(pi);
}

/* After exit: read what is available right now, then finalize. */
static void try_finish(int pi) {
    struct proc *p = &procs[pi];
    if (!p->used || !p->exited || p->finalized) return;
    if (p->conn >= 0 && !flush_ctl(pi)) return; /* waits for the client to read */
    for (int s = 0; s < 2; s++) {
        while (p->fd[s] >= 0 && p->drained < POST_EXIT_DRAIN) {
            int r = pump_output(pi, s);
            if (r == 0) {
                /* Nothing more now; but if we stopped only for backpressure,
                 * wait for the client to read and come back. */
                if (p->conn >= 0 && conns[p->conn].w.len >= OUT_CAP) return;
                close_fd(&p->fd[s]);
            }
        }
        close_fd(&p->fd[s]);
    }
    /* What the process sent on its control fd before it died comes after
     * its output and before EXIT (kept for a later ATTACH if detached). */
    for (int i = 0; i < 16 * CTL_BATCH && p->ctl_fd >= 0 && p->ctl.len < RING_CAP; i++)
        if (take_ctl(pi) < 0) break;
    close_fd(&p->ctl_fd);
    report_rejections(pi);
    if (p->conn >= 0) send_ctl_bytes(p->conn, &p->ctl);
    finalize(pi);
}

static void reap(void) {
    for (;;) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid <= 0) return;
        int pi = find_proc_pid(pid);
        if (pi < 0) continue; /* an orphan that reparented to us: just reaped */
        procs[pi].exited = 1;
        procs[pi].status = st;
        try_finish(pi);
    }
}

/* --- spawning -------------------------------------------------------------- */

struct reader {
    const unsigned char *p;
    size_t n, off;
    int bad;
};

static uint32_t rd_u32(struct reader *r) {
    if (r->off + 4 > r->n) { r->bad = 1; return 0; }
    uint32_t v = get_u32(r->p + r->off);
    r->off += 4;
    return v;
}

/* A NUL-terminated copy of a str field; strings with inner NULs are refused
 * (they cannot be passed to execve or chdir anyway). */
static char *rd_str(struct reader *r) {
    uint32_t n = rd_u32(r);
    if (r->bad || r->off + n > r->n) { r->bad = 1; return NULL; }
    if (memchr(r->p + r->off, 0, n)) { r->bad = 1; return NULL; }
    char *s = xrealloc(NULL, (size_t)n + 1);
    memcpy(s, r->p + r->off, n);
    s[n] = 0;
    r->off += n;
    return s;
}

static void free_strv(char **v) {
    if (!v) return;
    for (char **q = v; *q; q++) free(*q);
    free(v);
}

static char **rd_strv(struct reader *r) {
    uint32_t n = rd_u32(r);
    if (r->bad || n > 65536) { r->bad = 1; return NULL; }
    char **v = xrealloc(NULL, ((size_t)n + 1) * sizeof *v);
    memset(v, 0, ((size_t)n + 1) * sizeof *v);
    for (uint32_t i = 0; i < n; i++) {
        v[i] = rd_str(r);
        if (r->bad) { free_strv(v); return NULL; }
    }
    return v;
}

struct child_failure {
    int err;
    char stage[28];
};

static void child_fail(int status_fd, int err, const char *stage) {
    struct child_failure f;
    memset(&f, 0, sizeof f);
    f.err = err;
    snprintf(f.stage, sizeof f.stage, "%s", stage);
    ssize_t ignored = write(status_fd, &f, sizeof f);
    (void)ignored;
    _exit(127);
}

/* execvpe() searches the PATH of *our* environment; the child must use the
 * PATH of the environment it was given. */
static void exec_search(char **argv, char **envp, int status_fd) {
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        child_fail(status_fd, errno, "exec");
    }
    const char *path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) path = *e + 5;
    int saw_eacces = 0;
    char full[4096];
    const char *p = path;
    for (;;) {
        const char *colon = strchr(p, ':');
        size_t dl = colon ? (size_t)(colon - p) : strlen(p);
        int w = dl ? snprintf(full, sizeof full, "%.*s/%s", (int)dl, p, file)
                   : snprintf(full, sizeof full, "%s", file);
        if (w > 0 && (size_t)w < sizeof full) {
            execve(full, argv, envp);
            if (errno == EACCES) saw_eacces = 1;
        }
        if (!colon) break;
        p = colon + 1;
    }
    child_fail(status_fd, saw_eacces ? EACCES : ENOENT, "exec");
}

/* A pty pair for a child: master and slave, both close-on-exec (the child
 * dup2s the slave), the slave raw and sized (see "Pseudo-terminals").
 * Returns 0, or -1 with errno set and nothing left open. */
static int open_pty(int fds[2], const struct winsize *ws) {
    char path[64];
    struct termios t;
    fds[0] = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fds[0] < 0) return -1;
    if (grantpt(fds[0]) || unlockpt(fds[0]) || ptsname_r(fds[0], path, sizeof path)) goto fail;
    fds[1] = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fds[1] < 0) goto fail;
    if (tcgetattr(fds[1], &t)) goto fail;
    cfmakeraw(&t);
    if (tcsetattr(fds[1], TCSANOW, &t) || ioctl(fds[0], TIOCSWINSZ, ws)) goto fail;
    return 0;
fail: {
        int e = errno;
        close_fd(&fds[0]);
        close_fd(&fds[1]);
        errno = e;
        return -1;
    }
}

static void do_spawn(int ci, const unsigned char *pl, size_t n) {
    struct reader r = {pl, n, 0, 0};
    uint32_t flags = rd_u32(&r), uid = rd_u32(&r), gid = rd_u32(&r);
    char *name = rd_str(&r), *cwd = rd_str(&r);
    char **argv = rd_strv(&r), **envp = r.bad ? NULL : rd_strv(&r);
    struct winsize ws = {24, 80, 0, 0};
    if (!r.bad && r.off < r.n) { /* the optional size of a pty */
        uint32_t rows = rd_u32(&r), cols = rd_u32(&r);
        if (rows < 1 || rows > 0xFFFF || cols < 1 || cols > 0xFFFF) r.bad = 1;
        ws.ws_row = (unsigned short)rows;
        ws.ws_col = (unsigned short)cols;
    }
    int pipes[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}}, status[2] = {-1, -1}, ctl[2] = {-1, -1};
    int pty[2] = {-1, -1}; /* master, slave */
    int pi = -1;
    if (flags & F_PTY) flags |= F_MERGE; /* one stream */
    if (r.bad || !argv || !argv[0] || !envp || (flags & ~(uint32_t)F_ALL)) {
        send_error(ci, EINVAL, "malformed SPAWN request");
        goto out;
    }
    if (conns[ci].proc >= 0) {
        send_error(ci, EBUSY, "connection already bound to a process");
        goto out;
    }
    if ((flags & F_PERSISTENT) && (!name[0] || (find_proc_name(name) >= 0))) {
        send_error(ci, name[0] ? EEXIST : EINVAL,
                   name[0] ? "a persistent process with this name exists" : "persistent process needs a name");
        goto out;
    }
    for (int i = 0; i < MAX_PROCS; i++)
        if (!procs[i].used) { pi = i; break; }
    if (pi < 0) {
        send_error(ci, EAGAIN, "too many processes");
        goto out;
    }
    if ((flags & F_PTY) && open_pty(pty, &ws)) {
        send_error(ci, errno, "cannot open a pseudo-terminal (does the sandbox have /dev/ptmx and /dev/pts?)");
        goto out_fds;
    }
    if ((!(flags & F_PTY) && pipe2(pipes[0], O_CLOEXEC)) || pipe2(status, O_CLOEXEC) ||
        (!(flags & F_MERGE) && pipe2(pipes[1], O_CLOEXEC)) ||
        (!(flags & F_STDIN_NULL) && pipe2(pipes[2], O_CLOEXEC))) {
        send_error(ci, errno, "pipe failed");
        goto out_fds;
    }
    if (flags & F_CONTROL) {
        int one = 1;
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ctl) ||
            setsockopt(ctl[0], SOL_SOCKET, SO_PASSCRED, &one, sizeof one)) {
            send_error(ci, errno, "control socketpair failed");
            goto out_fds;
        }
    }
    pid_t pid = fork();
    if (pid < 0) {
        send_error(ci, errno, "fork failed");
        goto out_fds;
    }
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        setsid();
        /* A pty's slave becomes the new session's controlling terminal. */
        if (pty[1] >= 0 && ioctl(pty[1], TIOCSCTTY, 0) < 0) child_fail(status[1], errno, "TIOCSCTTY");
        int out = pty[1] >= 0 ? pty[1] : pipes[0][1];
        int in = (flags & F_STDIN_NULL) ? open("/dev/null", O_RDONLY) : pipes[2][0];
        if (in < 0 || dup2(in, 0) < 0 || dup2(out, 1) < 0 ||
            dup2((flags & F_MERGE) ? out : pipes[1][1], 2) < 0)
            child_fail(status[1], errno, "dup2");
        if (ctl[1] >= 0) {
            /* The status pipe must survive until exec: move it off CTL_FD. */
            if (status[1] == CTL_FD) status[1] = fcntl(status[1], F_DUPFD_CLOEXEC, CTL_FD + 1);
            /* dup2 onto itself would keep CLOEXEC; dup2 otherwise clears it. */
            if (ctl[1] == CTL_FD ? fcntl(CTL_FD, F_SETFD, 0) < 0 : dup2(ctl[1], CTL_FD) < 0)
                child_fail(status[1], errno, "control fd");
        }
        /* Close everything else except the status pipe (it is CLOEXEC). */
        close_others(status[1], ctl[1] >= 0 ? CTL_FD : -1);
        if (gid != 0xFFFFFFFFu && (setgroups(0, NULL) || setgid(gid))) child_fail(status[1], errno, "setgid");
        if (uid != 0xFFFFFFFFu && setuid(uid)) child_fail(status[1], errno, "setuid");
        if (chdir(cwd[0] ? cwd : "/")) child_fail(status[1], errno, "chdir");
        exec_search(argv, envp, status[1]);
    }
    close_fd(&status[1]);
    struct child_failure f;
    ssize_t got;
    do got = read(status[0], &f, sizeof f); while (got < 0 && errno == EINTR);
    close_fd(&status[0]);
    if (got == (ssize_t)sizeof f) {
        int st;
        waitpid(pid, &st, 0);
        char msg[96];
        snprintf(msg, sizeof msg, "%s: %s", f.stage, strerror(f.err));
        send_error(ci, f.err, msg);
        goto out_fds;
    }
    struct proc *p = &procs[pi];
    memset(p, 0, sizeof *p);
    p->used = 1;
    p->handle = next_handle++;
    p->pid = pid;
    p->persistent = !!(flags & F_PERSISTENT);
    p->name = name;
    name = NULL;
    p->pty = !!(flags & F_PTY);
    p->fd[0] = p->pty ? pty[0] : pipes[0][0];
    pty[0] = -1;
    close_fd(&pty[1]);
    p->fd[1] = (flags & F_MERGE) ? -1 : pipes[1][0];
    p->in_fd = (flags & F_STDIN_NULL) ? -1 : pipes[2][1];
    p->ctl_fd = ctl[0];
    ctl[0] = -1;
    close_fd(&ctl[1]);
    if (p->ctl_fd >= 0) set_nonblock(p->ctl_fd);
    close_fd(&pipes[0][1]);
    close_fd(&pipes[1][1]);
    close_fd(&pipes[2][0]);
    pipes[0][0] = pipes[1][0] = pipes[2][1] = -1;
    for (int s = 0; s < 2; s++)
        if (p->fd[s] >= 0) set_nonblock(p->fd[s]);
    if (p->in_fd >= 0) set_nonblock(p->in_fd);
    p->conn = ci;
    conns[ci].proc = pi;
    unsigned char v[8];
    put_u32(v, (uint32_t)pid);
    put_u32(v + 4, p->handle);
    send_frame(ci, R_STARTED, v, 8);
    goto out;
out_fds:
    for (int i = 0; i < 3; i++) { close_fd(&pipes[i][0]); close_fd(&pipes[i][1]); }
    close_fd(&status[0]);
    close_fd(&status[1]);
    close_fd(&ctl[0]);
    close_fd(&ctl[1]);
    close_fd(&pty[0]);
    close_fd(&pty[1]);
out:
    free(name);
    free(cwd);
    free_strv(argv);
    free_strv(envp);
}

/* --- requests ---------------------------------------------------------------- */

static void flush_ring(int ci, struct proc *p) {
    for (int s = 0; s < 2; s++) {
        struct ring *r = &p->ring[s];
        while (r->len) {
            size_t n = r->len < CHUNK ? r->len : CHUNK;
            unsigned char tmp[CHUNK];
            for (size_t i = 0; i < n; i++) tmp[i] = r->p[(r->head + i) % RING_CAP];
            r->head = (r->head + n) % RING_CAP;
            r->len -= n;
            send_frame(ci, s == 0 ? R_STDOUT : R_STDERR, tmp, n);
        }
    }
}

static void do_attach(int ci, const unsigned char *pl, size_t n) {
    struct reader r = {pl, n, 0, 0};
    char *name = rd_str(&r);
    if (r.bad) { send_error(ci, EINVAL, "malformed ATTACH"); return; }
    int pi = find_proc_name(name);
    free(name);
    if (pi < 0) { send_error(ci, ENOENT, "no persistent process with this name"); return; }
    struct proc *p = &procs[pi];
    if (p->conn >= 0) { send_error(ci, EBUSY, "another client is attached"); return; }
    if (conns[ci].proc >= 0) { send_error(ci, EBUSY, "connection already bound"); return; }
    unsigned char v[24];
    put_u32(v, (uint32_t)p->pid);
    put_u32(v + 4, p->handle);
    for (int s = 0; s < 2; s++) {
        uint64_t d = p->ring[s].dropped;
        put_u32(v + 8 + 8 * s, (uint32_t)(d >> 32));
        put_u32(v + 12 + 8 * s, (uint32_t)d);
        p->ring[s].dropped = 0;
    }
    send_frame(ci, R_ATTACHED, v, 24);
    flush_ring(ci, p);
    if (p->finalized) {
        send_ctl_bytes(ci, &p->ctl);
        send_exit(ci, p->status);
        return;
    }
    p->conn = ci;
    conns[ci].proc = pi;
    report_rejections(pi);
    flush_ctl(pi);
}

static void do_list(int ci) {
    struct buf b = {0};
    uint32_t count = 0;
    for (int i = 0; i < MAX_PROCS; i++) count += procs[i].used && procs[i].persistent;
    unsigned char v[4];
    put_u32(v, count);
    buf_put(&b, v, 4);
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *p = &procs[i];
        if (!p->used || !p->persistent) continue;
        put_u32(v, (uint32_t)strlen(p->name));
        buf_put(&b, v, 4);
        buf_put(&b, p->name, strlen(p->name));
        put_u32(v, (uint32_t)p->pid);
        buf_put(&b, v, 4);
        put_u32(v, p->handle);
        buf_put(&b, v, 4);
        unsigned char alive = !p->finalized;
        buf_put(&b, &alive, 1);
        put_u32(v, p->finalized ? (uint32_t)p->status : 0xFFFFFFFFu);
        buf_put(&b, v, 4);
        unsigned char att = p->conn >= 0;
        buf_put(&b, &att, 1);
        unsigned char r64[8];
        put_u64(r64, p->ctl_rejected);
        buf_put(&b, r64, 8);
    }
    for (int i = 0; i < MAX_PROCS; i++) { /* protocol 3: each one's terminal */
        struct proc *p = &procs[i];
        if (!p->used || !p->persistent) continue;
        struct winsize ws = {0, 0, 0, 0};
        unsigned char t[5] = {(unsigned char)p->pty, 0, 0, 0, 0};
        if (p->pty && p->fd[0] >= 0 && ioctl(p->fd[0], TIOCGWINSZ, &ws) == 0) {
            t[1] = (unsigned char)(ws.ws_row >> 8);
            t[2] = (unsigned char)ws.ws_row;
            t[3] = (unsigned char)(ws.ws_col >> 8);
            t[4] = (unsigned char)ws.ws_col;
        }
        buf_put(&b, t, 5);
    }
    send_frame(ci, R_LIST, b.p, b.len);
    buf_free(&b);
}

static void handle_frame(int ci, int type, const unsigned char *pl, size_t n) {
    struct conn *c = &conns[ci];
    struct proc *p = c->proc >= 0 ? &procs[c->proc] : NULL;
    switch (type) {
    case T_HELLO: {
        unsigned char v[20];
        uint32_t open_conns = 0;
        for (int i = 0; i < MAX_CONNS; i++) open_conns += conns[i].used;
        put_u32(v, PROTO_VERSION);
        put_u32(v + 4, (uint32_t)getpid());
        put_u64(v + 8, refused_peers);
        put_u32(v + 16, open_conns);
        send_frame(ci, R_HELLO, v, 20);
        break;
    }
    case T_SPAWN:
        do_spawn(ci, pl, n);
        break;
    case T_STDIN:
        if (!p || p->in_fd < 0 || p->in_close) send_error(ci, EPIPE, "no open stdin");
        else buf_put(&p->in, pl, n);
        break;
    case T_STDIN_CLOSE:
        if (p) p->in_close = 1;
        break;
    case T_SIGNAL:
        if (n != 4) send_error(ci, EINVAL, "malformed SIGNAL");
        else if (!p) send_error(ci, ESRCH, "not bound to a process");
        else if (!p->exited) kill(-p->pid, (int)get_u32(pl));
        break;
    case T_ATTACH:
        do_attach(ci, pl, n);
        break;
    case T_DETACH:
        if (!p || !p->persistent) { send_error(ci, EINVAL, "not attached to a persistent process"); break; }
        p->conn = -1;
        c->proc = -1;
        send_frame(ci, R_DETACHED, NULL, 0);
        break;
    case T_LIST:
        do_list(ci);
        break;
    case T_FORGET: {
        struct reader r = {pl, n, 0, 0};
        char *name = rd_str(&r);
        if (r.bad) { send_error(ci, EINVAL, "malformed FORGET"); break; }
        int pi = find_proc_name(name);
        free(name);
        if (pi < 0) send_error(ci, ENOENT, "no persistent process with this name");
        else if (!procs[pi].finalized || procs[pi].conn >= 0) send_error(ci, EBUSY, "process still running or attached");
        else { free_proc(pi); send_frame(ci, R_DETACHED, NULL, 0); }
        break;
    }
    default:
        send_error(ci, EINVAL, "unknown request type");
        c->closing = 1;
    }
}

static void drop_conn(int ci) {
    struct conn *c = &conns[ci];
    if (c->proc >= 0) {
        struct proc *p = &procs[c->proc];
        p->conn = -1;
        /* A one-shot command dies with its client (like a terminal hangup,
         * but certain): nobody could ever collect its result. */
        if (!p->persistent && !p->exited) kill(-p->pid, SIGKILL);
        if (!p->persistent && p->finalized) free_proc(c->proc);
    }
    close(c->fd);
    buf_free(&c->r);
    buf_free(&c->w);
    memset(c, 0, sizeof *c);
    c->proc = -1;
}

static void read_conn(int ci) {
    struct conn *c = &conns[ci];
    unsigned char tmp[CHUNK];
    ssize_t n = read(c->fd, tmp, sizeof tmp);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) { drop_conn(ci); return; }
    buf_put(&c->r, tmp, (size_t)n);
    while (c->used && !c->closing && c->r.len >= 5) {
        uint32_t len = get_u32(c->r.p);
        if (len == 0 || len > MAX_FRAME) {
            send_error(ci, EMSGSIZE, "bad frame length");
            c->closing = 1;
            break;
        }
        if (c->r.len < 4 + (size_t)len) break;
        handle_frame(ci, c->r.p[4], c->r.p + 5, len - 1);
        if (!conns[ci].used) return;
        buf_consume(&c->r, 4 + (size_t)len);
    }
}

static void accept_conn(void) {
    for (;;) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        /* Only crabd, from an ancestor pid namespace (pid 0 here); see the top. */
        struct ucred uc;
        socklen_t ul = sizeof uc;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &ul) || ul != sizeof uc || uc.pid != 0) {
            close(fd);
            refused_peers++;
            continue;
        }
        int ci = -1;
        for (int i = 0; i < MAX_CONNS; i++)
            if (!conns[i].used) { ci = i; break; }
        if (ci < 0) { close(fd); continue; }
        memset(&conns[ci], 0, sizeof conns[ci]);
        conns[ci].used = 1;
        conns[ci].fd = fd;
        conns[ci].proc = -1;
    }
}

/* --- shutdown ------------------------------------------------------------------ */

static void signal_all(int sig) {
    if (is_pid1) {
        kill(-1, sig);
        return;
    }
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i].used && !procs[i].exited) kill(-procs[i].pid, sig);
}

static int deadline_passed(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > term_deadline.tv_sec ||
           (now.tv_sec == term_deadline.tv_sec && now.tv_nsec >= term_deadline.tv_nsec);
}

static int children_left(void) {
    if (is_pid1) {
        siginfo_t si;
        memset(&si, 0, sizeof si);
        return waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) == 0;
    }
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i].used && !procs[i].exited) return 1;
    return 0;
}

static void handle_signals(void) {
    struct signalfd_siginfo si;
    while (read(sig_fd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (si.ssi_signo == SIGCHLD) continue; /* reaped below */
        if (!terminating) {
            terminating = 1;
            clock_gettime(CLOCK_MONOTONIC, &term_deadline);
            term_deadline.tv_sec += 3;
            signal_all(SIGTERM);
        }
    }
    reap();
}

/* --- main loop ------------------------------------------------------------------ */

/* --- the PID 1 keeper (see the top) ----------------------------------------------- */

/* Returns in the child (crab-init proper); the keeper itself never returns. */
static void keeper(void) {
    sigset_t all, old;
    sigfillset(&all);
    /* Blocked before the fork: a signal that arrives meanwhile waits for sigwaitinfo. */
    if (sigprocmask(SIG_BLOCK, &all, &old)) die("sigprocmask");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        if (sigprocmask(SIG_SETMASK, &old, NULL)) die("sigprocmask");
        return;
    }
    prctl(PR_SET_NAME, "crab-keeper", 0, 0, 0);
    for (;;) {
        siginfo_t si;
        int sig = sigwaitinfo(&all, &si);
        if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
            kill(child, sig);
        } else if (sig == SIGCHLD) {
            int st;
            pid_t pid;
            while ((pid = waitpid(-1, &st, WNOHANG)) > 0) /* crab-init, or an orphan */
                if (pid == child) _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
        }
    }
}

/* --lo-up (see the top): runc's state on stdin -> its "pid" -> that process's netns -> lo up. */
static int lo_up(void) {
    static char state[65536];
    size_t got = 0;
    for (;;) {
        if (got == sizeof state - 1) { errno = EFBIG; die("--lo-up: runc's state on stdin"); }
        ssize_t n = read(0, state + got, sizeof state - 1 - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("--lo-up: read stdin");
        if (n == 0) break;
        got += (size_t)n;
    }
    state[got] = 0;
    /* runc's specs.State: {"ociVersion":..,"id":..,"status":..,"pid":N,...}; the first "pid" key is it. */
    const char *p = strstr(state, "\"pid\"");
    if (!p) { errno = EINVAL; die("--lo-up: no pid in runc's state"); }
    p += 5;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (*p++ != ':') { errno = EINVAL; die("--lo-up: no pid in runc's state"); }
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    long pid = 0;
    for (; *p >= '0' && *p <= '9'; p++) {
        pid = pid * 10 + (*p - '0');
        if (pid > 4194304) { errno = ERANGE; die("--lo-up: pid in runc's state"); } /* PID_MAX_LIMIT */
    }
    if (pid <= 0) { errno = EINVAL; die("--lo-up: pid in runc's state"); }
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/ns/net", pid);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0) die(path);
    if (setns(ns, CLONE_NEWNET)) die("--lo-up: setns");
    close(ns);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) die("--lo-up: socket");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    memcpy(ifr.ifr_name, "lo", 3);
    if (ioctl(s, SIOCGIFFLAGS, &ifr)) die("--lo-up: SIOCGIFFLAGS lo");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr)) die("--lo-up: SIOCSIFFLAGS lo");
    close(s);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--lo-up") == 0) return lo_up();
    int kept = argc > 1 && strcmp(argv[1], "--keeper") == 0;
    if (kept) {
        if (getpid() != 1) { errno = EINVAL; die("--keeper outside PID 1"); }
        keeper();
    }
    /* Before anything else: no ptrace, /proc/1/mem or /proc/1/fd for the
     * sandbox (see the top). */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) die("prctl(PR_SET_DUMPABLE)");
    is_pid1 = getpid() == 1;
    /* Under the keeper, orphans go to PID 1 (the keeper reaps them): CRIU restores an orphan whose
     * session leader is gone only as a child of the tree's root task, never of a subreaper. */
    if (!is_pid1 && !kept) prctl(PR_SET_CHILD_SUBREAPER, 1);
    signal(SIGPIPE, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    /* Blocked signals are never "ignored" for PID 1, so they reach the
     * signalfd even though PID 1 has no handlers. */
    if (sigprocmask(SIG_BLOCK, &mask, NULL)) die("sigprocmask");
    sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sig_fd < 0) die("signalfd");

    const char *name = getenv("CRAB_INIT_SOCKET");
    if (!name || !name[0]) name = "crab-init";
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t nl = strlen(name);
    if (nl > sizeof sa.sun_path - 2) { errno = ENAMETOOLONG; die("socket name"); }
    memcpy(sa.sun_path + 1, name, nl);
    listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listen_fd < 0) die("socket");
    if (bind(listen_fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl)))
        die("bind");
    if (listen(listen_fd, 64)) die("listen");
    for (int i = 0; i < MAX_CONNS; i++) conns[i].proc = -1;

    static struct pollfd pfd[2 + MAX_CONNS + 4 * MAX_PROCS];
    static int kind[2 + MAX_CONNS + 4 * MAX_PROCS], idx[2 + MAX_CONNS + 4 * MAX_PROCS];
    for (;;) {
        if (terminating && (!children_left() || deadline_passed())) {
            signal_all(SIGKILL);
            reap();
            return 0;
        }
        int n = 0;
        pfd[n] = (struct pollfd){sig_fd, POLLIN, 0}; kind[n] = 0; n++;
        if (!terminating) { pfd[n] = (struct pollfd){listen_fd, POLLIN, 0}; kind[n] = 1; n++; }
        for (int i = 0; i < MAX_CONNS; i++) {
            struct conn *c = &conns[i];
            if (!c->used) continue;
            short ev = 0;
            int blocked = c->proc >= 0 && procs[c->proc].in.len > STDIN_CAP;
            if (!c->closing && !blocked) ev |= POLLIN;
            /* crabd half-closes (shutdown SHUT_WR) when it leaves and waits
             * for us to close our end (initproto.py, aclose): notice that
             * even while stdin backpressure stops us reading the socket. */
            if (!c->closing) ev |= POLLRDHUP;
            if (c->w.len) ev |= POLLOUT;
            if (c->closing && !c->w.len) { drop_conn(i); continue; }
            pfd[n] = (struct pollfd){c->fd, ev, 0}; kind[n] = 2; idx[n] = i; n++;
        }
        for (int i = 0; i < MAX_PROCS; i++) {
            struct proc *p = &procs[i];
            if (!p->used || p->finalized) continue;
            int attached = p->conn >= 0;
            int room = !attached || conns[p->conn].w.len < OUT_CAP;
            for (int s = 0; s < 2; s++) {
                /* With control bytes waiting, read only what was written before them. */
                int held = attached && p->ctl.len && !p->owe[s];
                if (p->fd[s] >= 0 && room && !held) { pfd[n] = (struct pollfd){p->fd[s], POLLIN, 0}; kind[n] = 3 + s; idx[n] = i; n++; }
            }
            if (p->ctl_fd >= 0 && attached && room && !p->ctl.len) {
                pfd[n] = (struct pollfd){p->ctl_fd, POLLIN, 0}; kind[n] = 6; idx[n] = i; n++;
            }
            if (p->in_fd >= 0 && (p->in.len || p->in_close)) {
                pfd[n] = (struct pollfd){p->in_fd, POLLOUT, 0}; kind[n] = 5; idx[n] = i; n++;
            }
        }
        int r = poll(pfd, (nfds_t)n, terminating ? 100 : -1);
        if (r < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        for (int k = 0; k < n; k++) {
            if (!pfd[k].revents) continue;
            int i = idx[k];
            switch (kind[k]) {
            case 0: handle_signals(); break;
            case 1: accept_conn(); break;
            case 2:
                if (!conns[i].used) break;
                if (pfd[k].revents & POLLOUT) {
                    ssize_t w = write(conns[i].fd, conns[i].w.p, conns[i].w.len);
                    if (w > 0) buf_consume(&conns[i].w, (size_t)w);
                    else if (w < 0 && errno != EAGAIN && errno != EINTR) { drop_conn(i); break; }
                    /* Space freed: a drain that waited on backpressure may finish. */
                    if (conns[i].proc >= 0) {
                        flush_ctl(conns[i].proc);
                        try_finish(conns[i].proc);
                    }
                }
                if (conns[i].used && (pfd[k].revents & (POLLIN | POLLHUP | POLLERR | POLLRDHUP))) read_conn(i);
                break;
            case 3: case 4:
                if (procs[i].used && !procs[i].finalized && procs[i].fd[kind[k] - 3] >= 0) {
                    pump_output(i, kind[k] - 3);
                    flush_ctl(i);
                    try_finish(i);
                }
                break;
            case 6:
                if (procs[i].used && !procs[i].finalized && procs[i].ctl_fd >= 0 && procs[i].conn >= 0) {
                    read_ctl(i);
                    try_finish(i);
                }
                break;
            case 5: {
                struct proc *p = &procs[i];
                if (!p->used || p->in_fd < 0) break;
                if (p->in.len) {
                    ssize_t w = write(p->in_fd, p->in.p, p->in.len);
                    if (w > 0) buf_consume(&p->in, (size_t)w);
                    else if (w < 0 && errno != EAGAIN && errno != EINTR) { close_fd(&p->in_fd); buf_free(&p->in); }
                }
                if (p->in_fd >= 0 && !p->in.len && p->in_close) close_fd(&p->in_fd);
                break;
            }
            }
        }
    }
}
