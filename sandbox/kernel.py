"""The sandbox kernel: the long-lived Python process INSIDE each container (uid 65534, no network).

Not imported on the host: `DockerExecutor` sends this file's source over the container's stdin at
start (so the image never needs rebuilding when it changes); it runs under the image's python3.11.

Protocol, one JSON object per line over the attached stdin/stdout:
    host -> kernel   {"code": str, "max_output": int, "max_artifact_bytes": int}
    kernel -> host   {"ready": true}, then one reply per request:
                     {"exit": int, "oom": bool, "stdout": [head, tail, total_bytes], "stderr": [...],
                      "files": [{"name", "size", "data" (base64) or null}]}
User code never touches the protocol: its fd 0 is /dev/null and its fds 1/2 go to per-run files in
WORK/.kernel; the protocol uses private duplicates. Variables persist between runs like notebook
cells, and a trailing expression's repr is printed. Files written under WORK (not hidden) come back.
"""

import ast
import base64
import json
import linecache
import os
import shutil
import sys
import traceback

WORK = "/tmp"  # the size-capped tmpfs; the only writable place
PRIVATE = WORK + "/.kernel"
MPL_CACHE = "/opt/mplconfig"  # prebuilt by `assistant sandbox setup`, copied to $MPLCONFIGDIR
MAX_FILES = 50  # artifacts reported per run
MAX_SCAN = 5000  # directory entries looked at per scan


def main():
    ctl_in = os.fdopen(os.dup(0), "rb")
    ctl_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.makedirs(PRIVATE, exist_ok=True)
    mpl_dir = os.environ.get("MPLCONFIGDIR")
    if mpl_dir and os.path.isdir(MPL_CACHE) and not os.path.exists(mpl_dir):
        shutil.copytree(MPL_CACHE, mpl_dir)
    os.chdir(WORK)
    sys.path.insert(0, WORK)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    kernel_pid = os.getpid()
    reply(ctl_out, {"ready": True})
    for num, line in enumerate(ctl_in, 1):
        request = json.loads(line)
        try:
            result = run_cell(request, namespace, num, kernel_pid, devnull)
        except Exception:  # a failure of the kernel itself (e.g. EAGAIN at the pids cap): report, carry on
            if os.getpid() != kernel_pid:
                os._exit(1)
            for fd in (1, 2):
                os.dup2(devnull, fd)
            text = "sandbox kernel error:\n" + traceback.format_exc()
            result = {"exit": 1, "oom": False, "stdout": ["", "", 0], "stderr": [text, "", len(text.encode())],
                      "files": []}
        reply(ctl_out, result)


def reply(out, obj):
    out.write(json.dumps(obj).encode() + b"\n")
    out.flush()


def run_cell(request, namespace, num, kernel_pid, devnull):
    paths = (PRIVATE + "/stdout", PRIVATE + "/stderr")
    os.makedirs(PRIVATE, exist_ok=True)  # the code may have deleted it
    before = scan(WORK)
    oom_before = oom_kills()
    for fd, path in zip((1, 2), paths):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    exit_code = execute(request["code"], namespace, "<cell %d>" % num)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:
            pass
    if os.getpid() != kernel_pid:  # a fork of the user's code came back up here: never reply twice
        os._exit(exit_code if isinstance(exit_code, int) else 1)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    stdout, stderr = (read_window(p, request["max_output"]) for p in paths)
    for path in paths:  # a fresh file per run: stray children of this run keep writing to the old one
        os.unlink(path)
    return {
        "exit": exit_code,
        "oom": oom_kills() > oom_before,
        "stdout": stdout,
        "stderr": stderr,
        "files": changed_files(before, scan(WORK), request["max_artifact_bytes"]),
    }


def execute(code, namespace, filename):
    """Run a cell; returns an exit code. Never raises: errors are printed as the user's traceback."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, filename, "eval"), namespace)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - the user's error, reported as such
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # hide this frame
        traceback.print_exception(type(e), e, tb)
        return 1


def read_window(path, max_bytes):
    """[head, tail, total]: the whole output when it fits, else its first and last max_bytes/2."""
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        if total <= max_bytes:
            text = f.read().decode("utf-8", "replace")
            return [text, "", len(text.encode())]
        half = max_bytes // 2
        head = f.read(half)
        f.seek(total - half)
        tail = f.read(half)
    # Lengths are re-measured after decoding so the host's byte arithmetic stays consistent.
    head_s, tail_s = head.decode("utf-8", "replace"), tail.decode("utf-8", "replace")
    return [head_s, tail_s, total - len(head) - len(tail) + len(head_s.encode()) + len(tail_s.encode())]


def scan(root):
    """{relative path: (mtime_ns, size)} of the visible regular files under root."""
    found, stack, seen = {}, [root], 0
    while stack and seen < MAX_SCAN:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found[os.path.relpath(entry.path, root)] = (st.st_mtime_ns, st.st_size)
            except OSError:
                continue
    return found


def changed_files(before, after, budget):
    files = []
    for name in sorted(n for n in after if before.get(n) != after[n])[:MAX_FILES]:
        size = after[name][1]
        data = None
        if size <= budget:
            try:
                with open(os.path.join(WORK, name), "rb") as f:
                    raw = f.read(size + 1)
                if len(raw) <= budget:
                    data, budget = base64.b64encode(raw).decode(), budget - len(raw)
            except OSError:
                pass
        files.append({"name": name, "size": size, "data": data})
    return files


def oom_kills():
    """How many processes the kernel killed for memory in this container's cgroup (v1 or v2)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


if __name__ == "__main__":
    main()
