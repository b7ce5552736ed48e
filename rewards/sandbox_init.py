"""Pid 1 of a code_exec sandbox: builds the program's file system, then starts the runner.

rewards.sandbox starts this file's source as
    setpriv --pdeathsig KILL -- unshare --mount --pid --net --ipc --uts --fork --kill-child
        [--user --map-root-user] -- PY -I -S -c <this source>
so it runs as pid 1 of a new PID namespace, trusted, with capabilities over its new mount, PID,
network, IPC and UTS namespaces (the `--user` form: when the caller is not root). When it exits
the kernel kills every process left in the namespace; it exits as soon as the runner does, or
at its own deadline, whichever comes first.

It reads one JSON request line on stdin: python (the interpreter, bound read-only), binds (extra
read-only directories: the interpreter's prefix when it is not under /usr), nested (whether
this is the `--user` form), runner (the runner's source), code, job (cases.json for the runner,
without expected values), limits. It writes nothing on stdout (that is the runner's answers) and
one line on stderr when it cannot set up. Standard library only: it runs on the sandbox's
interpreter, not the project's.
"""
import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_STRICTATIME = 1024, 2048, 1 << 24
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers (no libc wrapper)
NOBODY = 65534
NEW_ROOT = "/tmp"  # where the new root is built: /tmp is private to this mount namespace
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "random", "urandom")
LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
         "stderr": "/proc/self/fd/2"}
MIB = 1 << 20
GRACE_S = 2.0  # pid 1 outlives the parent's deadline by this much at most

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built; the message names the step and the system's reason."""


def _c(text):
    return None if text is None else text.encode()


def _check(ret, what):
    if ret != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def mount(source, target, fstype, flags, data=None):
    _check(libc.mount(_c(source), _c(target), _c(fstype), ctypes.c_ulong(flags), _c(data)),
           f"mount {target}")


def locked_flags(path):
    """The source mount's nosuid/nodev/noexec/atime flags: a read-only remount of a bind must
    keep them, or the kernel refuses it inside a user namespace (they are locked there)."""
    have = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME)):
        if have & st:
            flags |= ms
    if not have & (os.ST_RELATIME | os.ST_NOATIME):
        flags |= MS_STRICTATIME
    return flags


def bind_read_only(source, target):
    """Non-recursive, so no mount below `source` comes along (and none stays writable)."""
    os.makedirs(target, exist_ok=True)
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
          | locked_flags(source))


def tmpfs(target, size_mb, mode, flags=MS_NOSUID | MS_NODEV | MS_NOEXEC, inodes=4096):
    os.makedirs(target, exist_ok=True)
    mount("sandbox", target, "tmpfs", flags, f"size={size_mb}m,nr_inodes={inodes},mode={mode}")


def build_root(req):
    """A tmpfs root holding only: /usr (and the other system directories) read-only, /dev with
    four devices, a /proc of this PID namespace, a private /work with the program and /tmp."""
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
    # A fresh proc: only this namespace's processes. Mounted while the host's /proc is still
    # visible, which the kernel requires of a proc mount inside a user namespace.
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    limits = req["limits"]
    tmpfs(root + "/work", limits["disk_mb"], "0777")
    tmpfs(root + "/tmp", limits["disk_mb"], "1777")
    for name, text in (("solution.py", req["code"]), ("cases.json", json.dumps(req["job"]))):
        with open(f"{root}/work/{name}", "w", encoding="utf-8") as f:
            f.write(text)
    os.chdir(root)
    # pivot_root, not chroot: a process with capabilities in its own user namespace can leave
    # a chroot. The old root is then detached, so no path leads back to the host's files.
    _check(libc.syscall(PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _check(libc.sethostname(b"sandbox", 7), "sethostname")


def become_runner(req, ready_w, go_r):
    """In the forked child: own user namespace with only uid/gid 65534 mapped, limits, then the
    runner with an empty environment. Unprivileged after execve: no capabilities anywhere."""
    # First to go when the host runs out of memory (a program's processes together may pass
    # memory_mb, which is per process): before the trainer. A preference, not a bound: the
    # program may lower it back to 0, not below.
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    if not req["nested"]:
        os.setgroups([])  # under --map-root-user setgroups is denied, and there is none to drop
    _check(libc.unshare(CLONE_NEWUSER), "unshare the runner's user namespace")
    os.write(ready_w, b"u")
    if os.read(go_r, 1) != b"g":
        raise SetupError("pid 1 did not map the runner's user")
    # No user namespaces below this one: they are how most kernel bugs are reached unprivileged.
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    limits = req["limits"]
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    for which, value in ((resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_AS, limits["memory_mb"] * MIB),
                         (resource.RLIMIT_FSIZE, limits["file_mb"] * MIB),
                         (resource.RLIMIT_NOFILE, limits["open_files"]),
                         (resource.RLIMIT_NPROC, limits["processes"]),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.chdir("/work")
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 2)  # fd 1 stays: the parent's pipe, for the answers
    python = req["python"]
    os.execve(python, [python, "-I", "-S", "-c", req["runner"]], {})


def start_runner(req):
    """Fork the runner; write its uid/gid maps from here, the parent user namespace."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    err = os.dup(2)  # close-on-exec: setup errors reach the parent, the program never does
    pid = os.fork()
    if pid == 0:
        try:
            become_runner(req, ready_w, go_r)
        except (SetupError, OSError) as e:
            os.write(err, f"sandbox-init: runner: {e}\n".encode())
        os._exit(125)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) != b"u":
        raise SetupError("the runner could not enter its own user namespace")
    outer = 0 if req["nested"] else NOBODY  # 0: the caller, under --map-root-user
    for name, text in (("setgroups", "deny"), ("uid_map", f"{NOBODY} {outer} 1"),
                       ("gid_map", f"{NOBODY} {outer} 1")):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)
    os.write(go_w, b"g")
    return pid


def main():
    req = json.loads(sys.stdin.buffer.readline())
    # Our own deadline too, for when the parent died before it could kill us; later than the
    # parent's, which normally acts first.
    signal.signal(signal.SIGALRM, lambda *_: os._exit(124))
    signal.setitimer(signal.ITIMER_REAL, req["limits"]["timeout_s"] + GRACE_S)
    # Not dumpable: the runner (the same host user, under --map-root-user) cannot ptrace us
    # or read our /proc files.
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "set non-dumpable")
    try:
        build_root(req)
        runner = start_runner(req)
    except (SetupError, OSError, KeyError) as e:
        sys.stderr.write(f"sandbox-init: {e}\n")
        sys.stderr.flush()
        os._exit(125)
    while True:  # reap orphans (pid 1 inherits them) until the runner itself is done
        pid, _ = os.wait()
        if pid == runner:
            os._exit(0)


if __name__ == "__main__":
    main()
