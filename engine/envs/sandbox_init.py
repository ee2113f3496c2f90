"""The sandbox's launcher: run as root by `sandbox.run_python` (`python -I -S sandbox_init.py`), with
the job as JSON on stdin. Standard library only, and it never imports rlflow, so it starts in ~20 ms.

The launcher enters new mount, pid, network, IPC and UTS namespaces and forks the namespace's init
(pid 1). Init builds a root of its own (a size-capped tmpfs holding read-only binds of the system
directories and the interpreter's prefix, a fresh /proc and four device nodes; no /home, /root,
/tmp or checkout), chroots into it and forks the program, which drops to an unprivileged uid of its
own under CPU, memory, file-size, process and file-count limits and execs the interpreter. When
the program exits, init exits and the kernel kills whatever it left in the namespace (a fork bomb's
children included). Init reports the program's end on the status pipe as one JSON line.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_MOUNT_SETATTR, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 442, 0x8000, 0x1, 0x2
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "random", "urandom")
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()

    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _bind_read_only(source: str, target: str) -> None:
    """A recursive bind, read-only all the way down: mount_setattr(AT_RECURSIVE) where the kernel has it
    (5.12+); else each mount under `target` (from mountinfo) remounted read-only."""
    _mount(source, target, None, MS_BIND | MS_REC)
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    at_fdcwd = ctypes.c_int(-100)
    if libc.syscall(SYS_MOUNT_SETATTR, at_fdcwd, target.encode(), AT_RECURSIVE, attr, ctypes.sizeof(attr)) == 0:
        return
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in points:
        if point == target or point.startswith(target + "/"):
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def _build_root(root: str, job: dict) -> None:
    """root: an empty directory, seen only by this mount namespace from here on."""
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['disk_mb']}m,mode=755")
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            os.mkdir(root + path)
            _bind_read_only(path, root + path)
    prefix = job["python_prefix"]
    if not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        os.makedirs(root + prefix)
        _bind_read_only(prefix, root + prefix)
    os.mkdir(root + "/dev")
    for name in DEVICES:
        open(root + "/dev/" + name, "w").close()
        _mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    os.mkdir(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    work = root + "/work"
    os.mkdir(work, 0o700)
    with open(work + "/main.py", "w", encoding="utf-8") as f:
        f.write(job["code"])
    for path in (work, work + "/main.py"):
        os.chown(path, job["uid"], job["uid"])
    os.chroot(root)
    os.chdir("/work")


def _exec_program(job: dict) -> None:
    """The program: pid 2 of the namespace; never returns."""
    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CPU: (job["cpu_s"], job["cpu_s"] + 1),
        resource.RLIMIT_AS: (job["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (job["file_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (job["nproc"],) * 2,
        resource.RLIMIT_NOFILE: (64, 64),
        resource.RLIMIT_CORE: (0, 0),
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, value)
    with open("/proc/self/oom_score_adj", "w") as f:  # out of memory, the kernel takes the sandbox first
        f.write("1000")
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")
    os.closerange(3, max(1 << 16, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8"}
    python = job["python"]
    os.execve(python, [python, "-I", "-S", "-B", "main.py"], env)


def _report(status, record: dict) -> None:
    """One JSON line on the status pipe: how the program ended, or why the sandbox could not be built."""
    status.write(json.dumps(record) + "\n")
    status.flush()


def _init(job: dict, status) -> None:
    """pid 1 of the namespace: build the root, run the program, report how it ended; never returns."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed -> the namespace dies
    # The deadline holds even if the caller died: init exits, and with it every process in the namespace.
    signal.signal(signal.SIGALRM, lambda *_: os._exit(SETUP_FAILED - 1))
    signal.alarm(max(1, int(job["wall_s"] + 1)))
    try:
        _build_root(job["root"], job)
    except OSError as exc:
        _report(status, {"setup_error": str(exc)})
        os._exit(SETUP_FAILED)
    program = os.fork()
    if program == 0:
        try:
            _exec_program(job)
        finally:
            os._exit(SETUP_FAILED)
    while True:  # init reaps every orphan; the program's end is the namespace's
        pid, wait_status = os.wait()
        if pid == program:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    end = {"exit": os.waitstatus_to_exitcode(wait_status), "cpu_s": usage.ru_utime + usage.ru_stime}
    _report(status, end)
    os._exit(0)


def main() -> None:
    caller = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the caller killed -> so is this launcher
    if os.getppid() != caller:
        sys.exit(SETUP_FAILED)
    job = json.loads(sys.stdin.read())
    status = os.fdopen(job["status_fd"], "w")
    try:
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here is seen outside
    except OSError as exc:
        _report(status, {"setup_error": str(exc)})
        sys.exit(SETUP_FAILED)
    init = os.fork()
    if init == 0:
        _init(job, status)
    os.waitpid(init, 0)


if __name__ == "__main__":
    main()
