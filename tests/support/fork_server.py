"""A preloaded fork server for the scenario scripts, so that a run does not pay torch's and vLLM's
import again (7-13 s each on 2 cores) while still starting from the state a fresh interpreter
would have after the same imports.

A server is a long-lived ``python fork_server.py`` started with the environment, working
directory and ``sys.path[0]`` of the runs it serves. It executes the heavy modules among a
script's *leading imports* (the import statements before its first other statement, followed
into the ``support`` helpers it imports), then forks one child per run; the child takes the run's
environment, argv and standard streams, and runs the script as ``__main__``. Because only leading
imports are preloaded, no script code (a monkeypatch of ``torch.cuda``, say) ever runs before a
module the fresh interpreter would have imported after it.

A run is given to a server only where the fork cannot differ from a fresh interpreter: the same
executable, ``PYTHONPATH``, working directory and ``sys.path[0]``; every environment variable the
preload read through ``os.environ`` equal in the run's environment (a switch read at import
would be stale otherwise), and so are the variables that native libraries read at load
(``CUDA_*``, ``OMP_*``, ``PYTHON*``...); a preload that left a Python thread running, listed the
environment (other than a known prefix reader) or initialised CUDA is never forked. Anything else runs in a fresh interpreter, as does everything with
``FLASHNEXT_TEST_FORK_SERVER=0``. The child reseeds NumPy's global generator (Python's ``random``
reseeds itself at fork), replays what the preload printed, and exits as the interpreter does
(non-daemon threads joined, ``atexit`` run, streams flushed). Native thread pools started at
import (NumPy's OpenBLAS) rebuild themselves in the child. What stays shared with the server:
the hash seed (``PYTHONHASHSEED`` unset gives every child the server's), and anything a module
computed at import from ``sys.argv`` or ``os.getpid()``.
"""

from __future__ import annotations

import ast
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SWITCH = "FLASHNEXT_TEST_FORK_SERVER"
# what is worth preloading: imported by every vLLM scenario, and slow
HEAVY = ("torch", "numpy", "safetensors", "vllm", "vllm.config", "vllm.distributed")
# read by native code (CUDA, OpenMP, BLAS, the dynamic loader, Python's own startup), which the
# preload's os.environ record cannot see
NATIVE_PREFIXES = ("CUDA_", "NVIDIA_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON", "MALLOC_",
                   "TORCH_", "PYTORCH_", "NCCL_", "GLOO_", "TRITON_", "LC_", "LANG", "TZ")
MAX_SERVERS = 3


# --- which runs a server may take -----------------------------------------------------------------

def _leading_imports(source: str, support_dir: Path, seen: set | None = None) -> list[str]:
    """The modules a script imports before it runs anything else, into the support helpers."""
    seen = set() if seen is None else seen
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return []
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    modules = []
    for node in body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            break
        for name in names:
            modules.append(name)
            local = support_dir / (name.split(".", 1)[1].replace(".", "/") + ".py") if name.startswith("support.") else None
            if local is not None and local.is_file() and name not in seen:
                seen.add(name)
                modules += _leading_imports(local.read_text(), support_dir, seen)
    return modules


def preload_for(source: str, support_dir: Path) -> tuple[str, ...]:
    leading = set(_leading_imports(source, support_dir))
    return tuple(m for m in HEAVY if m in leading)


def _native_env(env, listed: tuple = ()) -> dict:
    """The variables read where the preload's record cannot see them, or by prefix."""
    return {k: v for k, v in env.items() if k.startswith(NATIVE_PREFIXES + tuple(listed))}


# --- the client -----------------------------------------------------------------------------------

class _Server:
    def __init__(self, key: tuple, preload: tuple[str, ...], env: dict, cwd: str, path0: str):
        self.key, self.preload = key, preload
        self.dir = tempfile.mkdtemp(prefix="flashnext-fork-")
        self.socket_path = os.path.join(self.dir, "s")
        self.log = open(os.path.join(self.dir, "server.log"), "w")
        self.proc = subprocess.Popen([sys.executable, __file__, self.socket_path, path0, *preload], env=env, cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        hello = self.proc.stdout.readline()  # the stdin pipe is its lifeline: closed, it exits
        self.hello = json.loads(hello) if hello else {"ready": False, "why": "the server died while preloading"}
        self.env_read: dict = self.hello.get("env_read", {})
        self.native: dict = self.hello.get("native_env", {})

    @property
    def ready(self) -> bool:
        return bool(self.hello.get("ready")) and self.proc.poll() is None

    def serves(self, env: dict) -> bool:
        return (self.ready and all(env.get(k) == v for k, v in self.env_read.items())
                and _native_env(env, self.hello.get("listed_prefixes", ())) == self.native)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_servers: list[_Server] = []
_refused: dict[tuple, str] = {}  # keys whose preload cannot be forked, and why
_lock = threading.Lock()


def _close_all() -> None:
    while _servers:
        _servers.pop().close()


import atexit  # noqa: E402

atexit.register(_close_all)


def _server_for(preload: tuple, env: dict, cwd: str, path0: str) -> _Server | None:
    key = (sys.executable, env.get("PYTHONPATH"), cwd, path0, preload)
    with _lock:
        if key in _refused:
            return None
        for server in _servers:
            if server.key == key and server.serves(env):
                _servers.remove(server)
                _servers.append(server)  # most recently used last
                return server
        # a server starts with this run's environment, which it then serves by construction
        server = _Server(key, preload, env, cwd, path0)
        if not server.ready:
            _refused[key] = server.hello.get("why") or "the server died"
            server.close()
            return None
        _servers.append(server)
        while len(_servers) > MAX_SERVERS:
            _servers.pop(0).close()
        return server if server.serves(env) else None


class ForkedRun:
    """A run in a server's child, with ``subprocess.Popen``'s ``communicate``, ``returncode``,
    ``pid``, ``kill`` for what the tests use."""

    def __init__(self, server: _Server, argv: list[str], env: dict, cwd: str, path0: str, source: str,
                 filename: str):
        self.argv = argv
        self.dir = tempfile.mkdtemp(prefix="flashnext-forked-run-")  # outlives an evicted server
        self.out_path, self.err_path = os.path.join(self.dir, "stdout"), os.path.join(self.dir, "stderr")
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(server.socket_path)
        request = {"argv": argv[1:], "env": env, "cwd": cwd, "path0": path0, "source": source, "filename": filename,
                   "stdout": self.out_path, "stderr": self.err_path}
        self.conn.sendall(json.dumps(request).encode() + b"\n")
        self.reader = self.conn.makefile("r")
        line = self.reader.readline()
        if not line:
            raise RuntimeError(f"the fork server did not start the run (its log: {server.log.name})")
        self.pid = json.loads(line)["pid"]
        self.returncode: int | None = None
        self._output: tuple[str, str] | None = None

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self._output is not None:
            return self._output
        if self.returncode is None:
            ready, _, _ = select.select([self.conn], [], [], timeout)
            if not ready:
                self.kill()
                raise subprocess.TimeoutExpired(self.argv, timeout)
            line = self.reader.readline()
            self.returncode = json.loads(line)["returncode"] if line else -9
            self.reader.close()
            self.conn.close()
        with open(self.out_path, errors="replace") as out, open(self.err_path, errors="replace") as err:
            self._output = out.read(), err.read()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self._output

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") not in ("0", "false", "no", "off", "")


def start(argv: list[str], env: dict, cwd: str | None = None) -> ForkedRun | subprocess.Popen:
    """``subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, text=True, env=env)`` for
    ``[sys.executable, "-c", SOURCE, *args]`` or ``[sys.executable, SCRIPT, *args]``, on a fork server
    where that is exact."""
    cwd = cwd or os.getcwd()
    run = None
    if enabled() and len(argv) >= 2 and argv[0] == sys.executable:
        support_dir = Path(__file__).resolve().parent
        if argv[1] == "-c" and len(argv) >= 3:
            source, filename, path0, rest = argv[2], "<string>", "", ["-c", *argv[3:]]
        elif not argv[1].startswith("-") and os.path.isfile(argv[1]):
            source, filename = Path(argv[1]).read_text(), argv[1]
            path0, rest = os.path.dirname(os.path.realpath(argv[1])), argv[1:]
        else:
            source = None
        if source is not None:
            preload = preload_for(source, support_dir)
            server = _server_for(preload, env, cwd, path0) if preload else None
            if server is not None:
                run = ForkedRun(server, [argv[0], *rest], env, cwd, path0, source, filename)
    if run is None:
        run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    return run


def run(argv: list[str], env: dict, timeout: float | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)``, forked where exact."""
    proc = start(argv, env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# --- the server -----------------------------------------------------------------------------------

# modules that list the environment at import, and the prefix of the names they then take
KNOWN_LISTERS = {os.path.join("tqdm", "utils.py"): "TQDM_", os.path.join("networkx", "utils", "backends.py"): "NETWORKX_"}


class _RecordingEnviron(os._Environ):
    read: set = set()
    prefixes: set = set()
    unknown_listers: list = []

    def __getitem__(self, key):
        frame, depth = sys._getframe(1), 0
        while frame is not None and depth < 4:  # a known lister's own reads: its prefix covers them
            if frame.f_code.co_filename.endswith(tuple(KNOWN_LISTERS)):
                break
            frame, depth = frame.f_back, depth + 1
        else:
            _RecordingEnviron.read.add(key)
        return super().__getitem__(key)

    def __iter__(self):
        import traceback

        stack = traceback.extract_stack(limit=8)[:-1]
        known = [prefix for frame in stack for lister, prefix in KNOWN_LISTERS.items() if frame.filename.endswith(lister)]
        if known:
            _RecordingEnviron.prefixes.update(known)
        else:
            _RecordingEnviron.unknown_listers.append("".join(traceback.format_list(stack)))
        return super().__iter__()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(socket_path: str, path0: str, preload: list[str]) -> None:
    import importlib

    sys.path[0] = path0  # as the runs' fresh interpreters have it
    captured = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    hello_fd = saved[1]  # the client reads one line from the original stdout
    for fd, f in captured.items():
        os.dup2(f.fileno(), fd)
    started_with = dict(os.environ)
    os.environ.__class__ = _RecordingEnviron
    why = None
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - the runs will meet it in a fresh interpreter instead
        why = f"preload failed: {type(e).__name__}: {e}"
    finally:
        os.environ.__class__ = os._Environ
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
    replay = {}
    for fd, f in captured.items():
        f.seek(0)
        replay[fd] = f.read()
    if why is None and _RecordingEnviron.unknown_listers:
        why = "the preload listed the whole environment:\n" + _RecordingEnviron.unknown_listers[0]
    # NumPy's OpenBLAS starts its pool at import and rebuilds it in a forked child (pthread_atfork);
    # a Python thread would not survive the fork
    if why is None and threading.active_count() > 1:
        why = f"the preload left Python threads running: {threading.enumerate()}"
    if why is None and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        why = "the preload initialised CUDA"
    env_read = {k: started_with.get(k) for k in sorted(_RecordingEnviron.read)}
    # what the imports set (vLLM sets a few variables), to set again over each run's environment
    env_set = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
    env_unset = sorted(set(started_with) - set(os.environ))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    listed = tuple(sorted(_RecordingEnviron.prefixes))
    message = {"ready": why is None, "why": why, "env_read": env_read, "listed_prefixes": listed,
               "native_env": _native_env(started_with, listed), "modules": len(sys.modules), "threads": _threads()}
    os.write(hello_fd, (json.dumps(message) + "\n").encode())
    if why is not None:
        print(why, file=sys.stderr)
        return
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):
            return  # the client is gone
        if listener in ready:
            conn, _ = listener.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                listener.close()
                _supervise(conn, replay, hello_fd, env_set, env_unset)
            conn.close()


def _supervise(conn: socket.socket, replay: dict, hello_fd: int, env_set: dict, env_unset: list) -> None:
    """In the server's child: read the request, fork the run, report its pid and exit status."""
    code = 70
    try:
        request = json.loads(conn.makefile("r").readline())
        pid = os.fork()
        if pid == 0:
            conn.close()
            os.close(hello_fd)
            _run_child(request, replay, env_set, env_unset)
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        returncode = os.waitstatus_to_exitcode(status)
        conn.sendall((json.dumps({"returncode": returncode}) + "\n").encode())
        code = 0
    finally:
        os._exit(code)


def _run_child(request: dict, replay: dict, env_set: dict, env_unset: list) -> None:
    """Become the run: its streams, environment, directory, argv; the script as ``__main__``."""
    import atexit as _atexit
    import types

    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
            os.write(fd, replay[fd])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(env_set)  # as the imports would have set them, from the same values read
        for name in env_unset:
            os.environ.pop(name, None)
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        sys.path[0] = request["path0"]
        sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # a fresh interpreter seeds it from the OS
        main = types.ModuleType("__main__")
        main.__dict__.update(__builtins__=__builtins__, __spec__=None, __package__=None, __cached__=None)
        if request["filename"] != "<string>":
            main.__file__ = request["filename"]
        sys.modules["__main__"] = main
        try:
            exec(compile(request["source"], request["filename"], "exec"), main.__dict__)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
            kind, value, tb = sys.exc_info()
            sys.excepthook(kind, value, tb.tb_next)  # without this runner's frame
            code = 1
        threading._shutdown()
        _atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3:])
