"""Pid 1 of a code_exec sandbox: builds the program's file system, then starts the runner.

rewards.sandbox starts this file's source as
    setpriv --pdeathsig KILL -- unshare --mount --pid --net --ipc --uts --fork --kill-child
        [--user --map-root-user] -- PY -I -S -c <this source>
so it runs as pid 1 of a new PID namespace, trusted, with capabilities over its new mount, PID,
network, IPC and UTS namespaces (the `--user` form: when the caller lacks CAP_SYS_ADMIN). When
it exits the kernel kills every process left in the namespace; it exits as soon as the runner
does, or at its own deadline, whichever comes first.

It reads one JSON request line on stdin: python (the interpreter, bound read-only), binds (extra
read-only directories: the interpreter's prefix when it is not under /usr), nested (whether this is
the `--user` form), cgroups (cgroup.procs files of the call's cgroups, to join first), runner (the
runner's source), code, job (cases.json for the runner, without expected values), limits
(timeout_s, setup_s, disk_mb) and rlimits (the runner's, see rewards.sandbox_limits). It writes
nothing on stdout (that is the runner's answers) and, when it cannot set up, one line starting
`sandbox-init:` on stderr. Standard library only: it runs on the sandbox's interpreter, not the
project's. rewards.sandbox also imports rlimit_problem and set_limits from here (the opt-out).
"""
import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_STRICTATIME = 1024, 2048, 1 << 24
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
# syscall numbers, no libc wrapper for either
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
KEYCTL, KEYCTL_JOIN_SESSION_KEYRING = {"x86_64": 250, "aarch64": 219}, 1
NOBODY = 65534
NEW_ROOT = "/tmp"  # where the new root is built: /tmp is private to this mount namespace
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "random", "urandom")
LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
         "stderr": "/proc/self/fd/2"}
MIB = 1 << 20
GRACE_S = 2.0  # pid 1's own deadline, from the runner's start: set-up allowance, timeout, this

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built; the message names the step and the system's reason."""

    def __init__(self, message, code=0):
        super().__init__(message)
        self.errno = code


def _c(text):
    return None if text is None else text.encode()


def _check(ret, what):
    if ret < 0:
        code = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(code)}", code)


def mount(source, target, fstype, flags, data=None):
    _check(libc.mount(_c(source), _c(target), _c(fstype), ctypes.c_ulong(flags), _c(data)),
           f"mount {target}")


def rlimit_problem(rlimits):
    """One line when a limit is above this process's hard limit, which only a privileged
    process could raise (the runner sets its limits unprivileged); else None."""
    for name, value, given, flag in rlimits:
        hard = resource.getrlimit(getattr(resource, name))[1]
        if hard != resource.RLIM_INFINITY and value > hard:
            field = given.partition("=")[0]
            return (f"{given} exceeds the hard {name} of {hard} (ulimit {flag}); lower {field} "
                    f"or raise that limit")
    return None


def set_limits(rlimits):
    """Soft and hard, so the program cannot raise them back."""
    for name, value, _, _ in rlimits:
        resource.setrlimit(getattr(resource, name), (value, value))


def locked_flags(path):
    """The mount's nosuid/nodev/noexec/atime flags: a read-only remount of a bind must keep
    them, or the kernel refuses it inside a user namespace (they are locked there)."""
    have = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME)):
        if have & st:
            flags |= ms
    if not have & (os.ST_RELATIME | os.ST_NOATIME):
        flags |= MS_STRICTATIME
    return flags


def mounts_at_or_below(target):
    """Mount points at `target` or below it, each once, from /proc/self/mountinfo."""
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            raw = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), line.split()[4])
            point = os.fsdecode(raw)
            if (point == target or point.startswith(target + "/")) and point not in found:
                found.append(point)
    return found


def bind_read_only(source, target):
    """Recursive: inside a user namespace the kernel refuses a plain bind of a tree with locked
    mounts below it (e.g. a GPU toolkit's binds under /usr). Each mount that came along is made
    read-only too, keeping its own locked flags, so none stays writable."""
    os.makedirs(target, exist_ok=True)
    mount(source, target, None, MS_BIND | MS_REC)
    for point in mounts_at_or_below(target):
        mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
              | locked_flags(point))


def tmpfs(target, size_mb, mode, flags=MS_NOSUID | MS_NODEV | MS_NOEXEC, inodes=4096):
    os.makedirs(target, exist_ok=True)
    mount("sandbox", target, "tmpfs", flags, f"size={size_mb}m,nr_inodes={inodes},mode={mode}")


def mount_proc(target):
    """A fresh proc: only this namespace's processes, and of those only the ones the viewer
    may ptrace, so not pid 1 (hidepid=ptraceable; `invisible` would show every process to the
    root group, the program's in the --user form under root), and no system files
    (subset=pid). Mounted while the host's /proc is still visible, which the kernel requires
    inside a user namespace."""
    os.mkdir(target)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        mount("proc", target, "proc", flags, "hidepid=ptraceable,subset=pid")
    except SetupError as e:
        if e.errno != errno.EINVAL:  # a kernel before 5.8 knows neither option
            raise
        mount("proc", target, "proc", flags)


def build_root(req):
    """A tmpfs root holding only: /usr (and the other system directories) read-only, /dev with
    four devices, a /proc of this PID namespace, a private /work with the program and /tmp.
    Returns a descriptor of the host's /proc, for the runner's one sysctl (see become_runner)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    root = NEW_ROOT
    mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for name in sorted(os.listdir("/")):
        host = "/" + name
        if os.path.islink(host):  # merged /usr: /bin -> usr/bin and the like
            target = os.readlink(host)
            if target.lstrip("/").split("/")[0] == "usr":
                os.symlink(target, root + host)
        elif name in SYSTEM_DIRS and os.path.isdir(host):
            bind_read_only(host, root + host)
    for path in req["binds"]:
        bind_read_only(path, root + path)
    tmpfs(root + "/dev", 1, "0755", MS_NOSUID | MS_NOEXEC, inodes=64)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in LINKS.items():
        os.symlink(target, f"{root}/dev/{name}")
    mount(None, root + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    mount_proc(root + "/proc")
    tmpfs(root + "/work", req["limits"]["disk_mb"], "0777")
    tmpfs(root + "/tmp", req["limits"]["disk_mb"], "1777")
    for name, text in (("solution.py", req["code"]), ("cases.json", json.dumps(req["job"]))):
        with open(f"{root}/work/{name}", "w", encoding="utf-8") as f:
            f.write(text)
    host_proc = os.open("/proc", os.O_PATH | os.O_DIRECTORY)  # not inherited across execve
    os.chdir(root)
    # pivot_root, not chroot: a process with capabilities in its own user namespace can leave
    # a chroot. The old root is then detached, so no path leads back to the host's files.
    _check(libc.syscall(PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _check(libc.sethostname(b"sandbox", 7), "sethostname")
    return host_proc


def become_runner(req, host_proc, ready_w, go_r):
    """In the forked child: own user namespace with only uid/gid 65534 mapped, limits, then the
    runner with an empty environment. Unprivileged after execve: no capabilities anywhere."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # pid 1 blocks SIGCHLD; execve keeps masks
    # First to go when the host (or the call's cgroup) runs out of memory. A preference, not a
    # bound: the program may lower it to 0, as any process may, never below (that needs
    # CAP_SYS_RESOURCE); the call's cgroup, where there is one, is the bound.
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    if not req["nested"]:
        os.setgroups([])  # under --map-root-user setgroups is denied, and there is none to drop
    _check(libc.unshare(CLONE_NEWUSER), "unshare the runner's user namespace")
    os.write(ready_w, b"u")
    if os.read(go_r, 1) != b"g":
        raise SetupError("pid 1 did not map the runner's user")
    # No user namespaces below this one: they are how most kernel bugs are reached unprivileged.
    # The sandbox's /proc has no sys/ (subset=pid): the host's, opened before pivot_root, has;
    # the sysctl written is this process's own user namespace's, whichever proc shows it.
    fd = os.open("sys/user/max_user_namespaces", os.O_WRONLY, dir_fd=host_proc)
    os.write(fd, b"0")
    os.close(fd)
    os.close(host_proc)
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    problem = rlimit_problem(req["rlimits"])
    if problem:
        raise SetupError(problem)
    set_limits(req["rlimits"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.chdir("/work")
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 2)  # fd 1 stays: the parent's pipe, for the answers
    python = req["python"]
    os.execve(python, [python, "-I", "-S", "-c", req["runner"]], {})


def start_runner(req, host_proc):
    """Fork the runner; write its uid/gid maps from here, the parent user namespace."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    err = os.dup(2)  # close-on-exec: setup errors reach the parent, the program never does
    pid = os.fork()
    if pid == 0:
        try:
            become_runner(req, host_proc, ready_w, go_r)
        except BaseException as e:  # never back into pid 1's code, whatever went wrong
            os.write(err, f"sandbox-init: runner: {type(e).__name__}: {e}\n".encode())
        os._exit(125)
    for fd in (ready_w, go_r, err, host_proc):
        os.close(fd)
    if os.read(ready_r, 1) != b"u":
        raise SetupError("the runner could not enter its own user namespace")
    outer = 0 if req["nested"] else NOBODY  # 0: the caller, under --map-root-user
    for name, text in (("setgroups", "deny"), ("uid_map", f"{NOBODY} {outer} 1"),
                       ("gid_map", f"{NOBODY} {outer} 1")):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)
    os.write(go_w, b"g")
    return pid


def join_call(req):
    """Into the call's cgroups (memory and process totals) and a new, empty session keyring
    (else the program shares the caller's, and its keys), before anything else is made."""
    # Joining a v1 cgroup waits for an RCU grace period (~10 ms here): most of this call's
    # overhead over a sandbox without cgroups; a thread during build_root did not gain it back.
    for procs in req["cgroups"]:
        with open(procs, "w") as f:
            f.write("0")  # 0: the writer itself
    ret = libc.syscall(KEYCTL[os.uname().machine], KEYCTL_JOIN_SESSION_KEYRING, None)
    if ret < 0 and ctypes.get_errno() != errno.ENOSYS:  # ENOSYS: a kernel without keyrings
        _check(ret, "join a new session keyring")


def main():
    """Set up, start the runner, then reap until it exits (0) or the deadline passes (124);
    any failure before is one `sandbox-init:` line on stderr and exit status 125."""
    # With no handler the kernel drops every signal the program sends to its namespace's pid 1
    # (the --user form runs both as the same host user); Python's SIGINT handler would not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # waited for below, not handled
    # Not dumpable: the runner (the same host user, in the --user form) cannot ptrace us or
    # read our /proc files. Our capabilities in a user namespace above the runner's already
    # stop that; this holds should that ever change.
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "set non-dumpable")
    try:
        req = json.loads(sys.stdin.buffer.readline())
        join_call(req)
        runner = start_runner(req, build_root(req))
        # Our own deadline too, for when the parent died before it could kill us: from the
        # runner's start (our own set-up, however slow on a loaded machine, is not the program's
        # time), so later than the parent's (its set-up allowance counts from before our
        # set-up, then the program's timeout), which normally acts first.
        limits = req["limits"]
        deadline = time.monotonic() + limits["setup_s"] + limits["timeout_s"] + GRACE_S
    except Exception as e:
        sys.stderr.write(f"sandbox-init: {e}\n")
        sys.stderr.flush()
        os._exit(125)
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 2)  # from here on nothing of ours can end up among the set-up errors
    while True:  # reap orphans (pid 1 inherits them) until the runner itself is done
        while True:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == runner:
                os._exit(0)
            if pid == 0:
                break
        left = deadline - time.monotonic()
        if left <= 0:
            os._exit(124)
        signal.sigtimedwait([signal.SIGCHLD], left)


if __name__ == "__main__":
    main()
