#!/usr/bin/env python3
"""The whole GPU loan as one detached pipeline: build, real-shape models, the matrix per model and routing.

A drawn task gets 15 minutes of device time in all (its start, every command and idle wait counted), 10
minutes a command, and the machine goes back 30 s after a command ends with none following. The pipeline
runs in its own session (setsid) on the machine, so work goes on between the commands; each command only
waits and copies what is done into $OUT. The defaults fit 15 minutes (one model, the rows that matter most,
each matrix command under a budget); with more time, name more (--models, --matrix-args):

    python3 tools/gpu/pipeline.py --detach && python3 tools/gpu/pipeline.py --wait 560 --out $OUT   # first
    python3 tools/gpu/pipeline.py --wait 200 --out $OUT                  # then, at once, with what is left

Steps, in order of what matters most (a loan cut short still returns the first ones):

    probe            tools/gpu/zero_copy_probe.cu built with nvcc and run (GPU only, before the build: it needs
                     none): the SMs' read rate of pinned host memory against the copy engine's, for the
                     matrix's bounds (RESULTS/probe.json)
    build            tools/gpu/build.py (CUDA, sm_90; skipped when a build of this pack is ready), with the
                     first model written beside it
    model M          tools/gpu/realshape.py --preset M
    engine check     the first model loaded through ggmoe's Engine with the cache on (auto decode mode, half
                     the experts) and 8 tokens decoded, in a fresh process. Every engine run on a GPU machine
                     has the system's libstdc++ preloaded: both loans saw the CUDA build segfault loading a
                     model without it (the second in modes.py and pytest, after this check had passed)
    modes            tools/gpu/modes.py on the first model: every decode mode's greedy tokens beside stock's,
                     async hits at 50 %, each mode in its own process (RESULTS/modes.json)
    gpu tests        pytest on each file of tests/gpu in its own process, uncaptured (-s: a CUDA abort's cause
                     reaches the log), RESULTS/gpu-tests.log
    matrix M random  tools/gpu/matrix.py, the model's own router: its default configurations, MoEpic's split
                     (split, split-async at 50 and 25 %, beside lru and async at the same VRAM) among them;
                     each cell in its own process with a time limit (a CUDA fault loses one cell)
    matrix M trace   tools/gpu/matrix.py --append, trace-replay routing (benchmark only)

for each model of --models (default gpt-oss-20b; qwen3-30b-a3b too where the loan is longer). Results go to --results (default
/tmp/ggmoe-results): RESULTS/M/matrix.{json,md}, steps.json (each step's seconds and exit status),
probe.json, modes.json, gpu-tests.log and pipeline.log; --out copies them flat as M.json, M.md, loan.json
(steps, probe, modes and the GPU tests' summary in one file), pipeline.log and build-tail.log (the device
tool brings back at most 8 files). Exit status of --wait: 0 finished, 3 still running, 2 a step failed,
4 never started.

``--cpu --models toy --matrix-args ...`` runs the same pipeline on a machine without a GPU (the smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # the repo root: tools.* when run as a file
from tools.gpu import build as gpu_build  # noqa: E402

DEFAULT_RESULTS = Path("/tmp/ggmoe-results")
# what the matrix does first: import ggmoe's engine (numpy and all), then load the model, experts on the host
# with the cache on (auto's decode mode and miss policy at half the experts: its choices and the measured costs
# it chose by, which the matrix then checks), a few tokens decoded: the loan's first question is
# whether ggmoe's own path runs, not only whether llama.cpp loads
ENGINE_CHECK = ("import sys; from ggmoe.cache import CacheConfig; from ggmoe.cache.decode_mode import DecodeConfig; "
                "from ggmoe.control.run_config import RunConfig; from ggmoe.engine import Engine, EngineConfig; "
                "from ggmoe.inspect import inspect_model; f = inspect_model(sys.argv[1]); "
                "eng = Engine(EngineConfig(model_path=sys.argv[1], n_ctx=64, n_gpu_layers=-1, "
                "run=RunConfig(CacheConfig(n_slots=max(f.n_expert_used + 1, f.n_expert // 2)), "
                "DecodeConfig(mode='auto', miss_policy='auto')))); "
                "[eng.decode([t]) for t in range(3, 11)]; st = eng.cache_stats.total(); "
                "print('engine check: loaded', sys.argv[1], eng.decode_mode, 'miss policy', eng.miss_policy, "
                "'hits', st.hits, 'misses', st.misses, 'on the CPU', st.host_computed); "
                "eng.close()")
DEFAULT_MODELS = "gpt-oss-20b"  # 15 minutes hold one model (the CUDA build alone takes about 250 s)
# the rows that matter most at 50 % and with every expert cached, each matrix command capped (seconds)
DEFAULT_MATRIX_ARGS = ("--configs stock-vram,n-cpu-moe,lru,hybrid,async-fill,async-fill-host,async-fill-tinylfu,"
                       "async-fill-prefetch,"
                       "async,lru-host,stock-cpu,async-tinylfu,async-prefetch,lru-auto --fractions 0.5,1.0 --runs 2 "
                       "--budget-s 150")
FINISHED, FAILED, RUNNING, NEVER = 0, 2, 3, 4


class Pipeline:
    def __init__(self, results: Path, prefix: Path, pack: Path, models: list[str], cpu: bool, trace: Path,
                 model_dir: Path, matrix_args: list[str], cuda_sites: list[Path]) -> None:
        self.results, self.prefix, self.pack, self.models = results, prefix, pack, models
        self.cpu, self.trace, self.model_dir, self.matrix_args = cpu, trace, model_dir, matrix_args
        self.cuda_sites = cuda_sites
        self.steps: dict[str, dict] = {}
        self.writer_env: dict | None = None
        # LD_PRELOAD for the engine's runs on a GPU machine: the system's libstdc++ (see engine check above)
        self.preload: str | None = None if cpu else find_libstdcxx()
        self.lock = threading.Lock()
        self.log = open(results / "pipeline.log", "a", buffering=1)  # noqa: SIM115 - open for the whole run

    def say(self, msg: str) -> None:
        self.log.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    def record(self, name: str, t0: float, rc: int) -> None:
        with self.lock:  # the first model's writer records from its own thread
            self.steps[name] = {"seconds": round(time.monotonic() - t0, 1), "exit": rc}
            (self.results / "steps.json").write_text(json.dumps(self.steps, indent=2))
            self.say(f"{name}: exit {rc} in {self.steps[name]['seconds']:.0f} s")

    def run(self, name: str, cmd: list[str], env: dict | None = None) -> int:
        self.say(f"{name}: {shlex.join(cmd)}")
        t0 = time.monotonic()
        rc = subprocess.run(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
        self.record(name, t0, rc)
        return rc

    def model_path(self, preset: str) -> Path:
        return self.model_dir / f"{preset}.gguf"

    def model_cmd(self, preset: str) -> list[str]:
        return [sys.executable, str(HERE / "realshape.py"), "--preset", preset, "-o", str(self.model_path(preset))]

    def engine_env(self) -> dict:
        """The environment env.sh gives: the built engine and the working tree on PYTHONPATH, cuBLAS's links."""
        env = dict(os.environ)
        site_dir, lib = self.prefix / "site", self.prefix / "cuda" / "lib"
        env["PYTHONPATH"] = f"{site_dir}:{ROOT}"
        if lib.is_dir():
            env["LD_LIBRARY_PATH"] = ":".join(x for x in (str(lib), env.get("LD_LIBRARY_PATH", "")) if x)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONFAULTHANDLER"] = "1"  # a fatal signal prints Python's stack (faults.py reads it)
        if self.preload:
            env["LD_PRELOAD"] = self.preload
        return env

    def zero_copy_probe(self) -> Path | None:
        """Build and run the zero-copy probe; its JSON (RESULTS/probe.json), or None if it failed."""
        exe = self.prefix / "zero_copy_probe"
        if self.run("probe build", ["nvcc", "-O2", "-arch=sm_90", "-o", str(exe),
                                    str(HERE / "zero_copy_probe.cu")]) != 0:
            return None
        t0 = time.monotonic()
        r = subprocess.run([str(exe), "256", "9"], capture_output=True, text=True, cwd=ROOT)
        self.record("probe", t0, r.returncode)
        self.say(f"probe: {r.stdout.strip()} {r.stderr.strip()}")
        if r.returncode != 0:
            return None
        out = self.results / "probe.json"
        out.write_text(r.stdout)
        return out

    def engine_check(self, model: Path) -> int:
        """Load ``model`` through ggmoe's Engine (as the matrix does) in a fresh process, cache on."""
        return self.run("engine check", [sys.executable, "-c", ENGINE_CHECK, str(model)], env=self.engine_env())

    def modes(self, model: Path) -> int:
        """Every decode mode on ``model`` beside stock (tools/gpu/modes.py), into RESULTS/modes.json."""
        cmd = [sys.executable, str(HERE / "modes.py"), "--model", str(model), "--out", str(self.results),
               *(["--cpu"] if self.cpu else [])]
        return self.run("modes", cmd, env=self.engine_env())

    def gpu_tests(self) -> int:
        """The GPU tier (tests/gpu, skipped without a GPU) with the packed pytest, one process per file (an abort
        loses one file), uncaptured so that a CUDA abort's cause is in RESULTS/gpu-tests.log."""
        env = self.engine_env()
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{self.prefix / 'deps'}"
        t0 = time.monotonic()
        self.say("gpu tests: pytest, each file of tests/gpu")
        rc = 0
        with open(self.results / "gpu-tests.log", "w", buffering=1) as log:
            for f in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
                log.write(f"==> {f.relative_to(ROOT)}\n")
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-rA", "-p", "no:cacheprovider",
                                    str(f.relative_to(ROOT))], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                log.write(f"<== {f.name}: exit {r.returncode}\n")
                rc = rc or r.returncode
        self.record("gpu tests", t0, rc)
        return rc

    def main(self) -> int:
        self.say(f"pipeline: models {', '.join(self.models)}; {'CPU' if self.cpu else 'CUDA'} build in {self.prefix}")
        # a copy: the working tree (and an uncarried gpu-pack) may be replaced by the next device command
        shutil.copy(self.trace, self.results / "trace.npz")
        self.trace = self.results / "trace.npz"
        build_cmd = [sys.executable, str(HERE / "build.py"), "--prefix", str(self.prefix), "--pack", str(self.pack),
                     *(["--cpu"] if self.cpu else []), *[x for d in self.cuda_sites for x in ("--cuda-site", str(d))]]
        self.model_dir.mkdir(parents=True, exist_ok=True)
        first = self.models[0]
        # the first model is written while the engine builds (the writer is one thread and the disk); it needs
        # gguf: the packed wheels, in a folder of their own (the build replaces its site folder)
        deps = self.prefix / "deps"
        if self.run("wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", str(deps),
                               *map(str, sorted((self.pack / "wheels").glob("*.whl")))]) != 0:
            return FAILED
        self.writer_env = {**os.environ, "PYTHONPATH": f"{deps}:{ROOT}"}
        writer = None
        if not self.model_path(first).is_file():
            proc = subprocess.Popen(self.model_cmd(first), stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=self.writer_env)
            t0 = time.monotonic()
            writer = threading.Thread(target=lambda: self.record(f"model {first}", t0, proc.wait()))
            writer.start()
        probe = None if self.cpu else self.zero_copy_probe()  # needs no build: first, so a short loan has it
        rc = self.run("build", build_cmd)
        while gpu_build.state(self.pack, self.prefix, self.cpu)[0] == gpu_build.RUNNING:  # started by another
            time.sleep(5)
        code, msg = gpu_build.state(self.pack, self.prefix, self.cpu)
        self.say(f"build: {msg.splitlines()[0]}")
        if writer is not None:
            writer.join()
        if rc != 0 or code != gpu_build.READY:
            return FAILED
        return self.measure(probe)

    def measure(self, probe: Path | None) -> int:
        """After the build: per model, written if missing; the first one checked (engine check, modes, GPU
        tests), then each one's matrix, both routings."""
        failed = False
        checked = False
        for preset in self.models:
            path = self.model_path(preset)
            if not path.is_file() and self.run(f"model {preset}", self.model_cmd(preset), env=self.writer_env) != 0:
                failed = True
                continue
            if not checked:
                checked = True
                if self.engine_check(path) != 0:
                    # a check that decodes and then aborts in close() stops nothing: the cells still run, each
                    # in its own process, and say per cell what broke
                    self.say("pipeline: the engine check failed; the matrix runs on, cell by cell")
                    failed = True
                failed |= self.modes(path) != 0
                failed |= self.gpu_tests() != 0
            out = self.results / preset
            for routing in ("random", "trace"):
                cmd = [sys.executable, str(HERE / "matrix.py"), "--model", str(path), "--trace", str(self.trace),
                       "--routing", routing, "--out", str(out), *(["--append"] if routing == "trace" else []),
                       *(["--probe", str(probe)] if probe is not None else []), *self.matrix_args]
                failed |= self.run(f"matrix {preset} {routing}", cmd, env=self.engine_env()) != 0
        self.say("pipeline: done" + (" (a step failed)" if failed else ""))
        return FAILED if failed else FINISHED


def find_libstdcxx() -> str | None:
    """The system's libstdc++.so.6 (what ldconfig knows), or None."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.strip().startswith("libstdc++.so.6 ") and "x86-64" in line and "=>" in line:
            return line.split("=>", 1)[1].strip()
    for p in ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6"):
        if Path(p).is_file():
            return p
    return None


def state(results: Path) -> tuple[int, str]:
    marker = results / "EXIT"
    pid_file = results / "PID"
    if marker.is_file():
        rc = int(marker.read_text().strip() or FAILED)
        return (FINISHED if rc == 0 else FAILED), f"finished (exit {rc})"
    if pid_file.is_file() and gpu_build._pid_alive(int(pid_file.read_text() or 0)):
        return RUNNING, f"running since {time.ctime(pid_file.stat().st_mtime)}"
    if pid_file.is_file():
        return FAILED, "the pipeline process is gone without a result"
    return NEVER, "never started"


DIGEST = ("==>", "<==", "PASSED", "FAILED", "ERROR", "SKIPPED", "E ", "llama.cpp", "Fatal Python error")


def tests_digest(log: Path, max_lines: int = 400) -> str:
    """The GPU tests' log cut to what says how each file went: its bounds, each test's outcome, assertion
    lines and a fatal abort's cause (the whole log is longer than loan.json should be)."""
    lines = log.read_text(errors="replace").splitlines()
    keep = [s[:400] for s in lines if s.lstrip().startswith(DIGEST)]
    return "\n".join(keep[-max_lines:])


def default_trace(pack: Path) -> Path:
    """The routing the trace rows replay: the pack's public real routing, else its tiled trace of the embedded
    model (a pack made without ../shared)."""
    real = pack / "real-routing.npz"
    return real if real.is_file() else pack / "trace.npz"


def collect(results: Path, prefix: Path, out: Path) -> list[str]:
    """Copy what is done into ``out``, flat (the device tool brings back 8 files, 2 folders deep)."""
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for d in sorted(p for p in results.iterdir() if p.is_dir()):
        for ext in ("json", "md"):
            src = d / f"matrix.{ext}"
            if src.is_file():
                shutil.copy(src, out / f"{d.name}.{ext}")
                copied.append(f"{d.name}.{ext}")
    loan = {}
    for key, name in (("steps", "steps.json"), ("probe", "probe.json"), ("modes", "modes.json")):
        if (results / name).is_file():
            try:
                loan[key] = json.loads((results / name).read_text())
            except ValueError as e:
                loan[key] = {"error": f"{name} is not JSON: {e}"}
    if (results / "gpu-tests.log").is_file():
        loan["gpu_tests"] = tests_digest(results / "gpu-tests.log")
    if loan:
        (out / "loan.json").write_text(json.dumps(loan, indent=2))
        copied.append("loan.json")
    if (results / "pipeline.log").is_file():
        shutil.copy(results / "pipeline.log", out / "pipeline.log")
        copied.append("pipeline.log")
    log = prefix / "build.log"
    if log.is_file():
        (out / "build-tail.log").write_text(gpu_build._tail(log, lines=200, width=400) + "\n")
        copied.append("build-tail.log")
    return copied


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    ap.add_argument("--prefix", type=Path, default=gpu_build.DEFAULT_PREFIX)
    ap.add_argument("--pack", type=Path, default=gpu_build.PACK)
    ap.add_argument("--models", default=DEFAULT_MODELS, help="realshape presets, in order")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/ggmoe-models"))
    ap.add_argument("--trace", type=Path, default=None,
                    help="default: PACK/real-routing.npz (public real routing), else PACK/trace.npz")
    ap.add_argument("--matrix-args", default=DEFAULT_MATRIX_ARGS,
                    help="arguments for every matrix.py run (one string; default: what fits a 15-minute loan)")
    ap.add_argument("--cpu", action="store_true", help="the CPU build (no GPU here)")
    ap.add_argument("--cuda-site", type=Path, action="append", default=[])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--detach", action="store_true", help="start the pipeline in its own session and return")
    g.add_argument("--wait", type=float, metavar="S", help="wait until it ends or S seconds have passed")
    g.add_argument("--status", action="store_true")
    g.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="with --wait/--status: copy the results here ($OUT)")
    return ap


def run_child(a, results: Path, prefix: Path, pack: Path, models: list[str]) -> int:
    """The detached pipeline itself; its exit status also in RESULTS/EXIT."""
    p = Pipeline(results, prefix, pack, models, a.cpu, (a.trace or default_trace(pack)).resolve(),
                 a.model_dir.resolve(), shlex.split(a.matrix_args), a.cuda_site)
    try:
        rc = p.main()
    except Exception as e:  # noqa: BLE001 - the marker and the log say what failed
        p.say(f"pipeline: {type(e).__name__}: {e}")
        rc = FAILED
    (results / "EXIT").write_text(str(rc))
    return rc


def detach(a, results: Path, prefix: Path, pack: Path, models: list[str]) -> int:
    """Start the pipeline in its own session (it outlives this command) unless one is running."""
    code, msg = state(results)
    if code == RUNNING:
        print(f"already {msg}")
        return 0
    if not (pack / "MANIFEST.json").is_file():
        raise SystemExit(f"error: {pack / 'MANIFEST.json'} is missing: run tools/gpu/pack.py here and carry "
                         "gpu-pack")
    results.mkdir(parents=True, exist_ok=True)
    (results / "EXIT").unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--results", str(results), "--prefix",
           str(prefix), "--pack", str(pack), "--models", ",".join(models), "--model-dir", str(a.model_dir),
           "--matrix-args", a.matrix_args, *(["--cpu"] if a.cpu else []),
           *(["--trace", str(a.trace)] if a.trace else []),
           *[x for d in a.cuda_site for x in ("--cuda-site", str(d))]]
    with open(results / "detached.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=ROOT)
    (results / "PID").write_text(str(proc.pid))
    print(f"started (pid {proc.pid}); results in {results}")
    return 0


def wait(a, results: Path, prefix: Path, pack: Path) -> int:
    """Wait up to --wait seconds (0: --status), say where it is and copy what is done to --out."""
    end = time.monotonic() + (a.wait or 0)
    code, msg = state(results)
    while code == RUNNING and time.monotonic() < end:
        time.sleep(min(5.0, max(0.1, end - time.monotonic())))
        code, msg = state(results)
    print(f"pipeline: {msg}")
    if (results / "steps.json").is_file():
        for name, s in json.loads((results / "steps.json").read_text()).items():
            print(f"  {name}: exit {s['exit']} in {s['seconds']:.0f} s")
    if code == RUNNING:
        bcode, bmsg = gpu_build.state(pack, prefix, a.cpu)
        if bcode == gpu_build.RUNNING:
            print(f"  build: {bmsg.splitlines()[0]}")
    if a.out is not None and results.is_dir():
        print(f"copied to {a.out}: {', '.join(collect(results, prefix, a.out))}")
    return code


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    results, prefix, pack = a.results.resolve(), a.prefix.resolve(), a.pack.resolve()
    models = [m for m in a.models.split(",") if m]
    if a.child:
        return run_child(a, results, prefix, pack, models)
    if a.detach:
        return detach(a, results, prefix, pack, models)
    return wait(a, results, prefix, pack)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `--status | head` ends quietly
    raise SystemExit(main())
