/*
 * weenv exec agent: runs commands inside a started environment without a new
 * runtime process per command.  See weenv/node/runtime/agent/__init__.py for the design
 * and the wire protocol; this file is compiled with `cc -static -O2`.
 *
 * Usage (as the environment's first process, pid 1, in front of its init):
 *
 *     weenv-agent [-u IDENT] [-c CAPS] -- COMMAND [ARG...]   (COMMAND: e.g. tini -- /app/server)
 *     weenv-agent [-u IDENT] [-c CAPS] --                    (hold: the agent itself stays pid 1)
 *     weenv-agent -t                                         (probe: exit 0, as true(1) does)
 *
 * IDENT is "UID:GID" or "UID:GID:G1,G2,..." (supplementary groups), CAPS the
 * environment's capability set as a hex bit mask.  With them the agent runs as
 * root holding CAPS plus CAP_SETUID, CAP_SETGID and CAP_SETPCAP (the node's
 * bundle gives it those) and *becomes* IDENT before it execs COMMAND, and
 * every command becomes the identity its request names: the bounding set is
 * cut to CAPS, the groups, gid and uid are set, and a root identity keeps
 * exactly CAPS (permitted and effective; a non-root one keeps none, as runc
 * leaves a non-root process after execve).  The server itself stays root.
 *
 * fd 0 is a listening Unix stream socket (the node passed it as runc create's
 * stdin).  The agent moves it off fd 0 (close-on-exec), puts /dev/null on
 * fd 0, forks a server (double fork: it is reparented to pid 1) and execs
 * COMMAND, which stays pid 1 and reaps the server if it dies.  Only the server
 * holds the socket, so once it is gone the node's connects are refused.  If
 * fd 0 is not a listening socket, the agent just execs COMMAND.
 *
 * Without COMMAND (hold mode: the template names no process of its own, so
 * nothing of the image, not even its `sleep`, needs to exist) the agent
 * becomes IDENT and stays pid 1 as the environment's init: it reaps every
 * child and orphan (the server among them) and exits on SIGTERM, SIGINT or
 * SIGHUP, which ends the environment.  The signals are blocked only here,
 * after the server is forked, so no command inherits the mask.
 *
 * The server accepts connections; each gets its own handler process (a child
 * subreaper) that reads one request, forks and execs the command with the
 * three passed descriptors as stdin/stdout/stderr, and reports on the
 * connection.  Everything the environment's first process was given by runc
 * (namespaces, cgroup, capabilities, seccomp filter, no_new_privs, rlimits,
 * user) is inherited through fork and exec.
 *
 * Request (node -> handler): u32 little-endian payload length, then the
 * payload: IDENT \0 CWD \0 ARGC[ COLS ROWS] \0 ARGV[0] \0 ... ARGV[ARGC-1] \0 ENV... (KEY=VALUE \0
 * each), sent with SCM_RIGHTS carrying exactly 3 descriptors (stdin, stdout,
 * stderr).  With " COLS ROWS" the command runs on a new pseudo-terminal of
 * that size instead (the 3 descriptors are closed unused): the handler opens
 * /dev/ptmx of the environment's own devpts (runc mounts it newinstance), so
 * the terminal belongs to the environment (`tty` names /dev/pts/N there); its
 * slave, owned by the command's user, is the command's controlling terminal
 * and its stdin, stdout and stderr; the master goes to the node (reply T).  The handler answers H and waits for one i32 0 ("go": meanwhile the
 * node moved the handler, whose host pid H's credentials show, into the
 * command's own cgroup, so the command and all it starts are born there).
 * Afterwards: little-endian i32 signal requests: N > 0 sends N to the
 * command, N < 0 sends -N to its process group.  End of file: SIGKILL to the
 * command and its process group.
 *
 * Replies (handler -> node), text lines:
 *     H              the request is read; waiting for "go" (SO_PASSCRED shows the handler's host pid)
 *     T              (terminal requests) sent with SCM_RIGHTS: the terminal's master
 *     A PID          forked
 *     P              the command runs (execve succeeded)
 *     F STAGE ERRNO  it could not start (STAGE: chdir, exec, setup, user); then EOF
 *     X STATUS       it ended; STATUS is waitpid(2)'s raw status; then EOF
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <termios.h>
#include <linux/capability.h>
#include <sys/fsuid.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_REQUEST (8u << 20) /* bytes of payload; execve(2) takes less */
#define STAGE_SETUP 1
#define STAGE_CHDIR 2
#define STAGE_EXEC 3
#define STAGE_USER 4
#define MAX_GROUPS 1024
#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif
#define MAX_TTY_SIDE 65535 /* struct winsize's fields are 16 bits; the node bounds them further */

/* -c: the environment's capability set (have_caps: given, so identities can be switched). */
static uint64_t env_caps;
static int have_caps;

extern char **environ;

/* The write end of the start pipe in pid 1 (see main): -1 elsewhere. */
static int start_fd = -1;

/* pid 1 will not run the environment's command: tell the server, which then
   never serves (a byte on the start pipe; EOF alone means the exec worked). */
static void start_failed(void) {
    if (start_fd >= 0) {
        char no = 'x';
        (void)!write(start_fd, &no, 1);
    }
}

static void die(const char *what) {
    dprintf(2, "weenv-agent: %s: %s\n", what, strerror(errno));
    start_failed();
    _exit(111);
}

/* Write all of buf (retrying on EINTR and partial writes); 0 or -1. */
static int write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == ENOTSOCK)
            n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Read exactly len bytes; 0, or -1 on error or early end of file. */
static int read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Send one reply line (best effort: a node that hung up gets nothing). */
__attribute__((format(printf, 2, 3))) static void reply(int conn, const char *fmt, ...) {
    char line[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0 && (size_t)n < sizeof line)
        (void)write_all(conn, line, (size_t)n);
}

/* Read the request header with its 3 descriptors (received close-on-exec). */
static int read_header(int conn, uint32_t *len, int fds[3]) {
    unsigned char head[4];
    char control[CMSG_SPACE(3 * sizeof(int))];
    struct iovec iov = {head, sizeof head};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do
        n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n <= 0)
        return -1;
    int got = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int *passed = (int *)CMSG_DATA(c);
        for (size_t i = 0; i < count; i++) {
            if (got < 3)
                fds[got++] = passed[i];
            else
                close(passed[i]);
        }
    }
    if (got != 3 || (msg.msg_flags & MSG_CTRUNC))
        return -1;
    if ((size_t)n < sizeof head && read_all(conn, head + n, sizeof head - (size_t)n) < 0)
        return -1;
    *len = head[0] | head[1] << 8 | head[2] << 16 | (uint32_t)head[3] << 24;
    return 0;
}

/* Split the payload into ident, cwd, argv (NULL-terminated), env (NULL-terminated)
   and the terminal's size (tty->ws_col == 0: no terminal). */
static int parse(char *buf, uint32_t len, char **ident, char **cwd, char ***argv, char ***env,
                 struct winsize *tty) {
    if (len == 0 || buf[len - 1] != '\0')
        return -1;
    size_t count = 0;
    for (uint32_t i = 0; i < len; i++)
        count += buf[i] == '\0';
    char **fields = calloc(count + 2, sizeof *fields);
    if (!fields)
        return -1;
    size_t k = 0;
    for (char *p = buf; p < buf + len; p += strlen(p) + 1)
        fields[k++] = p;
    if (k < 4)
        return -1;
    char *end;
    errno = 0;
    unsigned long argc = strtoul(fields[2], &end, 10);
    memset(tty, 0, sizeof *tty);
    if (!errno && *end == ' ') { /* " COLS ROWS": on a terminal */
        unsigned long cols = strtoul(end + 1, &end, 10);
        if (errno || *end != ' ')
            return -1;
        unsigned long rows = strtoul(end + 1, &end, 10);
        if (errno || cols == 0 || rows == 0 || cols > MAX_TTY_SIDE || rows > MAX_TTY_SIDE)
            return -1;
        tty->ws_col = (unsigned short)cols;
        tty->ws_row = (unsigned short)rows;
    }
    if (errno || *end || argc == 0 || argc > k - 3)
        return -1;
    *ident = fields[0];
    *cwd = fields[1];
    *argv = fields + 3;
    /* fields[3 + argc] starts the environment: shift it one slot right to
       leave a NULL after argv (calloc gave one spare slot at the end). */
    memmove(fields + 4 + argc, fields + 3 + argc, (k - 3 - argc) * sizeof *fields);
    fields[3 + argc] = NULL;
    *env = fields + 4 + argc;
    return 0;
}

/* The command's environment: the request's variables, then the agent's own
   (the environment's first process's, as runc set them: HOME etc.) whose
   names the request does not set. */
static char **merge_env(char **req) {
    size_t nr = 0, na = 0;
    while (req[nr])
        nr++;
    while (environ[na])
        na++;
    char **out = calloc(nr + na + 1, sizeof *out);
    if (!out)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < nr; i++)
        out[k++] = req[i];
    for (size_t j = 0; j < na; j++) {
        size_t name = strcspn(environ[j], "=");
        int dup = 0;
        for (size_t i = 0; i < nr && !dup; i++)
            dup = strncmp(req[i], environ[j], name) == 0 && req[i][name] == '=';
        if (!dup)
            out[k++] = environ[j];
    }
    return out;
}

/* Parse IDENT ("UID:GID" or "UID:GID:G1,G2,...").  0, or -1 if malformed. */
static int parse_ident(const char *s, uid_t *uid, gid_t *gid, gid_t *groups, size_t *ngroups) {
    char *end;
    errno = 0;
    unsigned long long u = strtoull(s, &end, 10);
    if (errno || end == s || *end != ':' || u > 0xfffffffeull)
        return -1;
    s = end + 1;
    unsigned long long g = strtoull(s, &end, 10);
    if (errno || end == s || (*end != ':' && *end != '\0') || g > 0xfffffffeull)
        return -1;
    *uid = (uid_t)u;
    *gid = (gid_t)g;
    *ngroups = 0;
    if (*end == '\0')
        return 0;
    s = end + 1;
    while (*s) {
        unsigned long long x = strtoull(s, &end, 10);
        if (errno || end == s || (*end != ',' && *end != '\0') || x > 0xfffffffeull || *ngroups >= MAX_GROUPS)
            return -1;
        groups[(*ngroups)++] = (gid_t)x;
        s = *end ? end + 1 : end;
    }
    return 0;
}

/* Become IDENT (see the top of the file); 0, or -1 with errno. */
static int become(const char *ident) {
    static gid_t groups[MAX_GROUPS];
    uid_t uid;
    gid_t gid;
    size_t n;
    if (!ident || !*ident)
        return 0; /* no identity named: stay as runc made us */
    if (!have_caps) {
        errno = EPERM;
        return -1;
    }
    if (parse_ident(ident, &uid, &gid, groups, &n) < 0) {
        errno = EINVAL;
        return -1;
    }
    for (int c = 0; c < 64; c++) /* needs CAP_SETPCAP, dropped with the rest below */
        if (!(env_caps >> c & 1) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
            return -1;
    if (setgroups(n, groups) < 0 || setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0)
        return -1;
    if (uid == 0) { /* root keeps the environment's set, not the agent's extra three */
        struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct data[2];
        memset(data, 0, sizeof data);
        data[0].effective = data[0].permitted = (uint32_t)env_caps;
        data[1].effective = data[1].permitted = (uint32_t)(env_caps >> 32);
        if (syscall(SYS_capset, &head, data) < 0)
            return -1;
    }
    return 0;
}

/* A new pseudo-terminal of the environment's devpts (/dev/ptmx as the
   environment sees it), of size *ws, its slave owned by IDENT's user: devpts
   gives a new slave the opener's fsuid (and the mount's gid=, tty), so ptmx is
   opened with IDENT's uid as the fsuid (CAP_SETUID; best effort: the command
   holds its slave open anyway).  0 with *master and *slave set
   (close-on-exec), or -1 with errno. */
static int open_terminal(const char *ident, const struct winsize *ws, int *master, int *slave) {
    static gid_t groups[MAX_GROUPS];
    uid_t uid;
    gid_t gid;
    size_t n;
    int as_user = have_caps && ident && *ident && parse_ident(ident, &uid, &gid, groups, &n) == 0;
    if (as_user)
        (void)setfsuid(uid);
    int m = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC), s = -1, unlock = 0, e = errno;
    if (as_user)
        (void)setfsuid(0);
    errno = e;
    if (m < 0)
        return -1;
    if (ioctl(m, TIOCSPTLCK, &unlock) < 0 || ioctl(m, TIOCSWINSZ, ws) < 0 ||
        (s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
        int e = errno;
        close(m);
        errno = e;
        return -1;
    }
    *master = m;
    *slave = s;
    return 0;
}

/* Send one reply line with the descriptor fd (SCM_RIGHTS); 0 or -1. */
static int send_fd(int conn, int fd, const char *line) {
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct iovec iov = {(void *)line, strlen(line)};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    ssize_t n;
    do
        n = sendmsg(conn, &msg, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)iov.iov_len ? 0 : -1;
}

/* In the forked child: become the command or report why not on errpipe.
   With tty, fds[0] is a terminal's slave: it becomes the controlling terminal. */
static void run_command(int fds[3], int tty, const char *ident, char *cwd, char **argv, char **env, int errpipe,
                        const sigset_t *mask) {
    int report[2] = {STAGE_SETUP, 0};
    if (setsid() < 0)
        goto fail;
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0) /* the copies are not close-on-exec */
            goto fail;
    if (tty && ioctl(0, TIOCSCTTY, 0) < 0)
        goto fail;
    report[0] = STAGE_USER;
    if (become(ident) < 0)
        goto fail;
    report[0] = STAGE_CHDIR;
    if (chdir(cwd) < 0)
        goto fail;
    report[0] = STAGE_SETUP;
    char **merged = merge_env(env);
    if (!merged)
        goto fail;
    environ = merged; /* execvp searches the command's own PATH, as runc does */
    if (sigprocmask(SIG_SETMASK, mask, NULL) < 0)
        goto fail;
    report[0] = STAGE_EXEC;
    execvp(argv[0], argv);
fail:
    report[1] = errno;
    (void)write_all(errpipe, report, sizeof report);
    _exit(127);
}

/* One connection: one command.  Never returns. */
static void handle(int conn) {
    uint32_t len;
    int fds[3];
    signal(SIGCHLD, SIG_DFL);
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); /* orphans of the command come here */
    prctl(PR_SET_NAME, "weenv-exec", 0, 0, 0);
    if (read_header(conn, &len, fds) < 0 || len > MAX_REQUEST) {
        reply(conn, "F %d %d\n", STAGE_SETUP, EPROTO);
        _exit(1);
    }
    char *buf = malloc(len ? len : 1), *ident, *cwd, **argv, **env;
    struct winsize tty;
    if (!buf || read_all(conn, buf, len) < 0 || parse(buf, len, &ident, &cwd, &argv, &env, &tty) < 0) {
        reply(conn, "F %d %d\n", STAGE_SETUP, EPROTO);
        _exit(1);
    }
    reply(conn, "H\n");
    unsigned char go[4];
    if (read_all(conn, go, sizeof go) < 0 || (go[0] | go[1] | go[2] | go[3]) != 0)
        _exit(1); /* the node hung up (or broke the protocol): nothing ran */
    sigset_t chld, old;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &chld, &old) < 0)
        die("sigprocmask");
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    int errpipe[2];
    if (sfd < 0 || pipe2(errpipe, O_CLOEXEC) < 0) {
        reply(conn, "F %d %d\n", STAGE_SETUP, errno);
        _exit(1);
    }
    int slave = -1;
    if (tty.ws_col) { /* the command's three descriptors: the terminal's slave */
        int master;
        if (open_terminal(ident, &tty, &master, &slave) < 0) {
            reply(conn, "F %d %d\n", STAGE_SETUP, errno);
            _exit(1);
        }
        if (send_fd(conn, master, "T\n") < 0)
            _exit(1); /* the node hung up: nothing ran */
        close(master);
        for (int i = 0; i < 3; i++) {
            close(fds[i]);
            fds[i] = slave;
        }
    }
    pid_t pid = fork();
    if (pid < 0) {
        reply(conn, "F %d %d\n", STAGE_SETUP, errno);
        _exit(1);
    }
    if (pid == 0) {
        close(errpipe[0]);
        run_command(fds, slave >= 0, ident, cwd, argv, env, errpipe[1], &old);
    }
    close(errpipe[1]);
    if (slave >= 0)
        close(slave); /* only the command holds it: the master reads EIO once it is gone */
    else
        for (int i = 0; i < 3; i++)
            close(fds[i]); /* only the command holds them: its pipes end with it */
    reply(conn, "A %d\n", (int)pid);

    int report[2];
    ssize_t n;
    do
        n = read(errpipe[0], report, sizeof report);
    while (n < 0 && errno == EINTR);
    close(errpipe[0]);
    int started = n == 0; /* close-on-exec closed the pipe: execve succeeded */
    if (started)
        reply(conn, "P\n");
    else if (n == (ssize_t)sizeof report)
        reply(conn, "F %d %d\n", report[0], report[1]);
    else
        reply(conn, "F %d %d\n", STAGE_SETUP, EPROTO);

    /* Wait for the command, reaping adopted orphans too, and obey signal requests. */
    struct pollfd pfd[2] = {{sfd, POLLIN, 0}, {started ? conn : -1, POLLIN, 0}};
    unsigned char req[4];
    size_t have = 0;
    for (;;) {
        int status;
        pid_t r;
        while ((r = waitpid(-1, &status, WNOHANG)) > 0) {
            if (r == pid) {
                if (started)
                    reply(conn, "X %d\n", status);
                _exit(0);
            }
        }
        if (poll(pfd, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            die("poll");
        }
        if (pfd[0].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0)
                ;
        }
        if (pfd[1].revents) {
            ssize_t m = read(conn, req + have, sizeof req - have);
            if (m < 0 && errno == EINTR)
                continue;
            if (m <= 0) { /* the node hung up: the command goes with it */
                kill(-pid, SIGKILL);
                kill(pid, SIGKILL);
                pfd[1].fd = -1;
                continue;
            }
            have += (size_t)m;
            if (have == sizeof req) {
                int32_t sig = (int32_t)(req[0] | req[1] << 8 | req[2] << 16 | (uint32_t)req[3] << 24);
                have = 0;
                if (sig > 0 && sig < 65)
                    kill(pid, sig);
                else if (sig < 0 && sig > -65)
                    kill(-pid, -sig);
            }
        }
    }
}

/* Hold mode (no COMMAND): stay pid 1, reap every child, exit on TERM/INT/HUP. */
static void hold(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &set, NULL) < 0) /* blocked, so pid 1 gets them (see signal(7)) */
        die("blocking signals");
    prctl(PR_SET_NAME, "weenv-init", 0, 0, 0);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        siginfo_t si;
        int sig = sigwaitinfo(&set, &si);
        if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP)
            _exit(0);
    }
}

static void serve(int lfd) {
    signal(SIGCHLD, SIG_IGN); /* handlers are reaped by the kernel */
    prctl(PR_SET_NAME, "weenv-agent", 0, 0, 0);
    for (;;) {
        int conn = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE ||
                errno == ENOBUFS || errno == ENOMEM)
                continue;
            die("accept");
        }
        pid_t pid = -1;
        for (int tries = 0; tries < 5 && pid < 0; tries++) {
            pid = fork();
            if (pid < 0 && errno != EAGAIN && errno != ENOMEM)
                break;
            if (pid < 0) /* at the pids or memory limit: give the environment a moment */
                usleep(10000);
        }
        if (pid == 0) {
            close(lfd);
            handle(conn);
        }
        if (pid < 0) /* the node sees the hang-up and uses runc exec for this command */
            dprintf(2, "weenv-agent: fork: %s\n", strerror(errno));
        close(conn);
    }
}

int main(int argc, char **argv) {
    const char *ident = NULL;
    int i = 1;
    if (argc == 2 && strcmp(argv[1], "-t") == 0) /* the node's first command: needs nothing of the image */
        return 0;
    for (; i + 1 < argc && argv[i][0] == '-' && argv[i][1] && !argv[i][2]; i += 2) {
        if (argv[i][1] == 'u') {
            ident = argv[i + 1];
        } else if (argv[i][1] == 'c') {
            char *end;
            errno = 0;
            env_caps = strtoull(argv[i + 1], &end, 16);
            if (errno || !*argv[i + 1] || *end)
                break;
            have_caps = 1;
        } else {
            break;
        }
    }
    if (argc - i < 1 || strcmp(argv[i], "--") != 0) {
        dprintf(2, "usage: weenv-agent [-u UID:GID[:GROUPS]] [-c CAPS] -- [COMMAND [ARG...]]\n");
        return 111;
    }
    argv += i - 1; /* argv[1] is "--" from here on */
    int listening = 0;
    socklen_t size = sizeof listening;
    if (getsockopt(0, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) == 0 && listening) {
        int lfd = fcntl(0, F_DUPFD_CLOEXEC, 3);
        int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (lfd < 0 || null < 0 || dup2(null, 0) < 0)
            die("setting up");
        close(null);
        /* The start pipe: the server accepts its first request only once pid 1
           has exec'd the environment's command (the write end is close-on-exec:
           EOF) or holds the environment; if pid 1 fails first (no such program,
           no such user), it writes a byte and the server exits unserved, so no
           request (the node's first probe included) succeeds in an environment
           whose command never ran (pid 1's exit then ends the namespace). */
        int start[2];
        if (pipe2(start, O_CLOEXEC) < 0)
            die("making the start pipe");
        pid_t mid = fork();
        if (mid < 0)
            die("fork");
        if (mid == 0) {
            pid_t server = fork();
            if (server == 0) {
                setsid(); /* out of the command's process group and session */
                close(start[1]);
                char got;
                ssize_t n;
                while ((n = read(start[0], &got, 1)) < 0 && errno == EINTR)
                    ;
                if (n != 0)
                    _exit(0); /* pid 1 failed: its exit ends the environment */
                close(start[0]);
                serve(lfd);
            }
            _exit(server < 0);
        }
        close(lfd);
        close(start[0]);
        start_fd = start[1];
        int status;
        while (waitpid(mid, &status, 0) < 0 && errno == EINTR)
            ;
    }
    if (become(ident) < 0)
        die("becoming the environment's user");
    if (!argv[2]) {
        if (start_fd >= 0)
            close(start_fd); /* the agent holds the environment itself: serve */
        start_fd = -1;
        hold();
    }
    execvp(argv[2], argv + 2);
    int failed = errno;
    dprintf(2, "weenv-agent: exec %s: %s\n", argv[2], strerror(failed));
    start_failed();
    return failed == ENOENT ? 127 : 126;
}
