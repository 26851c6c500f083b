/*
 * crab-init: PID 1 of every crab sandbox.
 *
 * crabd never uses `docker exec`: CRIU dumps only the process tree under the
 * container's PID 1, so anything started from outside would vanish on
 * restore.  Instead crabd asks this program to spawn every command and the
 * persistent shell session, so every process descends from PID 1.
 *
 * It listens on an ABSTRACT unix stream socket ("\0crab-init", or
 * $CRAB_INIT_SOCKET).  Abstract names live in the container's network
 * namespace: only a process that enters that namespace (crabd, as root)
 * can connect, and there is no file on the host a hostile sandbox could
 * replace with a symlink.
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
 *               u32 argc, str*argc, u32 envc, str*envc
 *               flags: 1 MERGE_STDERR, 2 PERSISTENT, 4 STDIN_NULL
 *   0x03 STDIN data   0x04 STDIN_CLOSE   0x05 SIGNAL u32 signo
 *   0x06 ATTACH str name   0x07 DETACH   0x08 LIST   0x09 FORGET str name
 * Init -> client:
 *   0x81 HELLO_OK u32 version, u32 pid
 *   0x82 STARTED u32 pid, u32 handle
 *   0x83 STDOUT data   0x84 STDERR data   0x85 EXIT i32 wait status
 *   0x86 ATTACHED u32 pid, u32 handle, u64 dropped_out, u64 dropped_err
 *   0x87 DETACHED
 *   0x88 LIST u32 n, n * (str name, u32 pid, u32 handle, u8 alive,
 *                          i32 status, u8 attached)
 *   0x8F ERROR u32 errno, str message
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROTO_VERSION 1
#define MAX_FRAME ((1u << 20) + 64)
#define OUT_CAP (256u * 1024)
#define RING_CAP (1u << 20)
#define STDIN_CAP (1u << 20)
#define CHUNK (64u * 1024)
#define POST_EXIT_DRAIN (4u << 20)
#define MAX_CONNS 256
#define MAX_PROCS 1024

enum { T_HELLO = 1, T_SPAWN, T_STDIN, T_STDIN_CLOSE, T_SIGNAL, T_ATTACH, T_DETACH, T_LIST, T_FORGET };
enum { R_HELLO = 0x81, R_STARTED, R_STDOUT, R_STDERR, R_EXIT, R_ATTACHED, R_DETACHED, R_LIST, R_ERROR = 0x8F };
enum { F_MERGE = 1, F_PERSISTENT = 2, F_STDIN_NULL = 4 };

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
    int fd[2];       /* stdout, stderr read ends; -1 when closed */
    int in_fd;       /* stdin write end, -1 when closed */
    struct buf in;   /* bytes waiting for the child's stdin */
    int in_close;    /* close stdin once `in` drains */
    int exited, status, finalized;
    size_t drained;  /* bytes read after exit */
    int conn;        /* attached connection, -1 if none */
    struct ring ring[2];
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
    buf_free(&p->in);
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
    }
    ssize_t n = read(p->fd[s], tmp, room);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (n <= 0) {
        close_fd(&p->fd[s]);
        return -1;
    }
    if (p->exited) p->drained += (size_t)n;
    if (p->conn >= 0)
        send_frame(p->conn, s == 0 ? R_STDOUT : R_STDERR, tmp, (size_t)n);
    else if (p->persistent)
        ring_put(&p->ring[s], tmp, (size_t)n);
    /* else: a one-shot process whose client left; discard. */
    return 1;
}

/* After exit: read what is available right now, then finalize. */
static void try_finish(int pi) {
    struct proc *p = &procs[pi];
    if (!p->used || !p->exited || p->finalized) return;
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

static void do_spawn(int ci, const unsigned char *pl, size_t n) {
    struct reader r = {pl, n, 0, 0};
    uint32_t flags = rd_u32(&r), uid = rd_u32(&r), gid = rd_u32(&r);
    char *name = rd_str(&r), *cwd = rd_str(&r);
    char **argv = rd_strv(&r), **envp = r.bad ? NULL : rd_strv(&r);
    int pipes[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}}, status[2] = {-1, -1};
    int pi = -1;
    if (r.bad || !argv || !argv[0] || !envp) {
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
    if (pipe2(pipes[0], O_CLOEXEC) || pipe2(status, O_CLOEXEC) ||
        (!(flags & F_MERGE) && pipe2(pipes[1], O_CLOEXEC)) ||
        (!(flags & F_STDIN_NULL) && pipe2(pipes[2], O_CLOEXEC))) {
        send_error(ci, errno, "pipe failed");
        goto out_fds;
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
        int in = (flags & F_STDIN_NULL) ? open("/dev/null", O_RDONLY) : pipes[2][0];
        if (in < 0 || dup2(in, 0) < 0 || dup2(pipes[0][1], 1) < 0 ||
            dup2((flags & F_MERGE) ? pipes[0][1] : pipes[1][1], 2) < 0)
            child_fail(status[1], errno, "dup2");
        /* Close everything else except the status pipe (it is CLOEXEC). */
        for (int fd = 3; fd < 65536; fd++)
            if (fd != status[1]) close(fd);
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
    p->fd[0] = pipes[0][0];
    p->fd[1] = (flags & F_MERGE) ? -1 : pipes[1][0];
    p->in_fd = (flags & F_STDIN_NULL) ? -1 : pipes[2][1];
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
        send_exit(ci, p->status);
        return;
    }
    p->conn = ci;
    conns[ci].proc = pi;
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
    }
    send_frame(ci, R_LIST, b.p, b.len);
    buf_free(&b);
}

static void handle_frame(int ci, int type, const unsigned char *pl, size_t n) {
    struct conn *c = &conns[ci];
    struct proc *p = c->proc >= 0 ? &procs[c->proc] : NULL;
    switch (type) {
    case T_HELLO: {
        unsigned char v[8];
        put_u32(v, PROTO_VERSION);
        put_u32(v + 4, (uint32_t)getpid());
        send_frame(ci, R_HELLO, v, 8);
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

int main(void) {
    is_pid1 = getpid() == 1;
    if (!is_pid1) prctl(PR_SET_CHILD_SUBREAPER, 1);
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

    static struct pollfd pfd[2 + MAX_CONNS + 3 * MAX_PROCS];
    static int kind[2 + MAX_CONNS + 3 * MAX_PROCS], idx[2 + MAX_CONNS + 3 * MAX_PROCS];
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
            if (c->w.len) ev |= POLLOUT;
            if (c->closing && !c->w.len) { drop_conn(i); continue; }
            pfd[n] = (struct pollfd){c->fd, ev, 0}; kind[n] = 2; idx[n] = i; n++;
        }
        for (int i = 0; i < MAX_PROCS; i++) {
            struct proc *p = &procs[i];
            if (!p->used || p->finalized) continue;
            int room = p->conn < 0 || conns[p->conn].w.len < OUT_CAP;
            for (int s = 0; s < 2; s++)
                if (p->fd[s] >= 0 && room) { pfd[n] = (struct pollfd){p->fd[s], POLLIN, 0}; kind[n] = 3 + s; idx[n] = i; n++; }
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
                    if (conns[i].proc >= 0) try_finish(conns[i].proc);
                }
                if (conns[i].used && (pfd[k].revents & (POLLIN | POLLHUP | POLLERR))) read_conn(i);
                break;
            case 3: case 4:
                if (procs[i].used && !procs[i].finalized && procs[i].fd[kind[k] - 3] >= 0) {
                    pump_output(i, kind[k] - 3);
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
