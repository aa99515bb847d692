#!/usr/bin/env python3
"""A model larger than RAM, decoded by stock llama.cpp (mmap) and by ggmoe's disk tier (``--host-ram``).

Each run is a process of its own, one at a time, on the same model (tools/fixtures/big_model.py's 32 GiB by default):

- ``stock``: ``llama_cpp.Llama(model, n_gpu_layers=0, use_mmap=True)``: llama.cpp's own load, the experts read
  through page faults on its mapping of the file, the page cache as the only host tier;
- ``ggmoe``: ``ggmoe.load(model, host_ram=...)``: the experts beyond the host budget stay in the file and are
  read with ``O_DIRECT`` into the host tier (docs/engine.md, "The disk tier").

Both drive the same teacher-forced tokens through ``Llama.eval``: a short prompt, a few warm-up tokens, then
``--tokens`` decode tokens one at a time, timed. Before each run the model's pages are dropped from the page
cache (``POSIX_FADV_DONTNEED`` on the file: no root needed for clean pages) and what stays cached is reported
(``mincore``), with /proc/meminfo's Cached and MemAvailable. Reported per mode, the median over runs:

- decode tokens per second;
- disk bytes per decode token: the process's ``read_bytes`` (/proc/self/io: page faults and ``O_DIRECT``
  reads alike) over the timed tokens, and for ggmoe its own count of bytes read into the host tier;
- for ggmoe, the share of its disk reads that a prediction started (``predicted_reads / reads``) and how
  many of those the decode used.

``--disk`` first times the disk itself on the model file: sequential ``O_DIRECT`` reads of 4 MiB, random ones of
64 KiB, 1 MiB and 4 MiB at 1 and 4 in flight. Not a test: run it by hand, alone (two CPU-heavy jobs on two cores
slow each other many times over).

    python tools/bench/bench_disk_tier.py [MODEL.gguf] [--modes stock,ggmoe] [--host-ram 16GiB] [--tokens 32]
                                    [--runs 3] [--disk] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("stock", "ggmoe")
TOKEN_IDS = 200  # teacher-forced ids stay below this: byte tokens every fixture vocabulary has
PAGE = mmap.PAGESIZE
ALIGN = 4096  # bytes: O_DIRECT's offset, length and buffer alignment


# --------------------------------------------------------------------------- the machine and its page cache


def meminfo() -> dict[str, int]:
    """/proc/meminfo's fields in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def read_bytes() -> int:
    """Bytes this process has had read from storage (/proc/self/io ``read_bytes``, every thread)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _block_device(path: Path) -> str | None:
    """The block device (sysfs name, partitions resolved to their disk) that holds ``path``, or None."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sys_dev.exists():
        return None
    real = sys_dev.resolve()
    return real.parent.name if (real / "partition").exists() else real.name


def device_read_bytes(dev: str | None) -> int:
    """Bytes read from the whole device so far (/sys/block/DEV/stat: sectors of 512 bytes; every process)."""
    if dev is None:
        return 0
    return int(Path(f"/sys/block/{dev}/stat").read_text().split()[2]) * 512


def machine(path: Path) -> dict[str, object]:
    """CPU model, cores, RAM and the disk that holds ``path``."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    dev = _block_device(path)
    disk: dict[str, object] = {"device": dev}
    if dev is not None:
        q = Path(f"/sys/block/{dev}/queue")
        disk["rotational"] = (q / "rotational").read_text().strip() == "1"  # virtio disks may claim 1
        disk["scheduler"] = (q / "scheduler").read_text().strip()
        disk["bytes"] = int(Path(f"/sys/block/{dev}/size").read_text()) * 512
        model = Path(f"/sys/block/{dev}/device/model")
        disk["model"] = model.read_text().strip() if model.exists() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": meminfo().get("MemTotal", 0), "disk": disk,
            "kernel": platform.release(), "root": os.geteuid() == 0}


def evict(path: Path) -> None:
    """Drop the file's clean pages from the page cache (no root needed; the system's other pages stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_bytes(path: Path, chunk: int = 1 << 30) -> int:
    """Bytes of the file in the page cache now: ``mincore`` over libc mappings of it, a chunk at a time
    (a mapping reads nothing; Python's mmap gives no address of a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size, total = path.stat().st_size, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap failed")
            vec = (ctypes.c_ubyte * ((n + PAGE - 1) // PAGE))()
            rc = libc.mincore(addr, n, vec)
            libc.munmap(addr, n)
            if rc != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            total += (len(vec) - bytes(vec).count(0)) * PAGE  # bit 0: resident; the others are reserved
    finally:
        os.close(fd)
    return min(total, size)


# --------------------------------------------------------------------------- the disk


def _direct_reads(path: Path, size: int, offsets: list[int], in_flight: int) -> float:
    """Seconds to read ``size`` bytes at each offset with ``O_DIRECT``, ``in_flight`` reads at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    local = threading.local()
    try:
        def read(at: int) -> None:
            if not hasattr(local, "buf"):
                local.buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
            os.preadv(fd, [local.buf], at)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as ex:
            list(ex.map(read, offsets))
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def disk_profile(path: Path, seq_bytes: int = 4 << 30, n_random: int = 128, seed: int = 0) -> dict[str, object]:
    """This disk's speeds on the model file (bytes/s and ms a read): sequential 4 MiB reads of its first
    ``seq_bytes``, then random reads of 64 KiB, 1 MiB and 4 MiB at 1 and 4 in flight, each at offsets the
    sequential pass did not touch where the file allows (no help from a cache under the guest)."""
    size = path.stat().st_size
    rng = random.Random(seed)
    seq = min(seq_bytes, size - size % (4 << 20))
    evict(path)
    secs = _direct_reads(path, 4 << 20, list(range(0, seq, 4 << 20)), 1)
    out: dict[str, object] = {"sequential_4MiB": {"bytes_per_s": round(seq / secs), "bytes": seq}}
    lo = seq if size - seq > (1 << 30) else 0
    for block in (64 << 10, 1 << 20, 4 << 20):
        for in_flight in (1, 4):
            n = n_random if block >= 1 << 20 else 4 * n_random
            offsets = [lo + rng.randrange(0, (size - lo - block) // ALIGN) * ALIGN for _ in range(n)]
            secs = _direct_reads(path, block, offsets, in_flight)
            out[f"random_{block >> 10}KiB_x{in_flight}"] = {"bytes_per_s": round(n * block / secs),
                                                          "ms_per_read": round(secs / n * in_flight * 1e3, 3)}
    return out


# --------------------------------------------------------------------------- one run (a child process)


def _counters(llm) -> dict[str, int]:
    """ggmoe's counters since load: the host tier's (their own names) and the expert cache's totals
    (``cache_`` + name); empty for stock."""
    stats = (llm.stats().get("cache") if hasattr(llm, "stats") else None) or {}
    out = {f"cache_{k}": v for k, v in (stats.get("total") or {}).items()}
    out.update(stats.get("host_tier") or {})
    return {k: v for k, v in out.items() if isinstance(v, int) and not isinstance(v, bool)}


def _setup(llm) -> dict[str, object]:
    """What ggmoe chose: the decode mode, the miss policy, the slots per layer of each tier (empty for stock)."""
    stats = (llm.stats().get("cache") if hasattr(llm, "stats") else None) or {}
    tier = stats.get("host_tier") or {}
    keys = ("decode_mode_in_effect", "decode_mode_reason", "miss_policy_in_effect", "policy")
    out = {k: stats[k] for k in keys if k in stats}
    out["slots_per_layer"] = sorted(set((stats.get("slots_per_layer") or {}).values()))
    out.update({k: tier[k] for k in ("host_slots_per_layer", "host_ram", "direct_io") if k in tier})
    return out if stats else {}


def _load(mode: str, model: Path, a: argparse.Namespace):
    common = dict(n_gpu_layers=0, n_ctx=a.n_ctx, n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    if mode == "stock":
        import llama_cpp

        return llama_cpp.Llama(str(model), use_mmap=True, **common)
    import ggmoe

    opts = {k: v for k, v in (("host_ram", a.host_ram), ("cache_slots", a.cache_slots),
                              ("policy", a.policy), ("predictor", a.predictor),
                              ("plan_predictor", a.plan_predictor)) if v is not None}
    return ggmoe.load(model, **opts, **common)


def worker(mode: str, model: Path, a: argparse.Namespace) -> None:
    """One run: load, prefill, warm up, decode ``a.tokens`` timed; a JSON line on stdout after each decode
    token (the parent keeps the last one, so a run cut by its timeout still reports what it did)."""
    rb0, t0 = read_bytes(), time.perf_counter()
    llm = _load(mode, model, a)
    rec: dict[str, object] = {"mode": mode, "load_s": round(time.perf_counter() - t0, 3),
                              "load_read_bytes": read_bytes() - rb0, "setup": _setup(llm)}
    ids = [(7 * i + 3) % TOKEN_IDS + 1 for i in range(a.prompt_tokens + a.warmup + a.tokens)]
    t1 = time.perf_counter()
    llm.eval(ids[:a.prompt_tokens])
    rec["prefill_s"] = round(time.perf_counter() - t1, 3)
    for t in ids[a.prompt_tokens:a.prompt_tokens + a.warmup]:
        llm.eval([t])
    rec["warmup_s"] = round(time.perf_counter() - t1 - rec["prefill_s"], 3)
    tier0, rb1, times, reads = _counters(llm), read_bytes(), [], []
    for t in ids[a.prompt_tokens + a.warmup:]:
        s, r = time.perf_counter(), read_bytes()
        llm.eval([t])
        times.append(time.perf_counter() - s)
        reads.append(read_bytes() - r)
        tier = {k: v - tier0.get(k, 0) for k, v in _counters(llm).items()}
        rec.update(decode_tokens=len(times), decode_s=round(sum(times), 3),
                   tok_s=round(len(times) / sum(times), 4), read_bytes=read_bytes() - rb1,
                   total_read_bytes=read_bytes() - rb0,
                   token_s=[round(x, 4) for x in times], token_read_bytes=reads, host_tier=tier)
        print(json.dumps(rec), flush=True)
    llm.close()


# --------------------------------------------------------------------------- the runs


WORKER_FLAGS = ("tokens", "warmup", "prompt_tokens", "n_ctx", "threads", "host_ram", "cache_slots", "policy",
                "predictor", "plan_predictor")


def _worker_argv(mode: str, model: Path, a: argparse.Namespace) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), str(model), "--worker", mode]
    for name in WORKER_FLAGS:
        value = getattr(a, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def _page_cache_state(model: Path) -> dict[str, object]:
    mem = meminfo()
    return {"model_cached_bytes": cached_bytes(model), "cached_bytes": mem.get("Cached", 0),
            "mem_available_bytes": mem.get("MemAvailable", 0), "loadavg_1m": round(os.getloadavg()[0], 2)}


def run_one(mode: str, model: Path, a: argparse.Namespace, dev: str | None) -> dict[str, object]:
    """One run in a child process after the model's pages are dropped; its last record, or what went wrong."""
    evict(model)
    before, dev0, t0 = _page_cache_state(model), device_read_bytes(dev), time.perf_counter()
    proc = subprocess.Popen(_worker_argv(mode, model, a), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=a.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        timed_out = True
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    rec: dict[str, object] = json.loads(lines[-1]) if lines else {"mode": mode, "decode_tokens": 0}
    rec.update(timed_out=timed_out, returncode=proc.returncode, wall_s=round(time.perf_counter() - t0, 1),
               device_read_bytes=device_read_bytes(dev) - dev0, before=before)
    if proc.returncode != 0 and not timed_out:
        rec["error"] = err.strip().splitlines()[-1] if err.strip() else f"exit status {proc.returncode}"
    return rec


def summarize(mode: str, runs: list[dict]) -> dict[str, object]:
    """Medians over the runs that decoded something; ggmoe's prediction shares over their sums."""
    done = [r for r in runs if r.get("decode_tokens")]
    out: dict[str, object] = {"runs": len(runs), "runs_decoding": len(done)}
    if not done:
        return out
    out["tok_s"] = statistics.median(r["tok_s"] for r in done)
    # the timed tokens' second half: nearer the steady state, where the tiers (or the page cache) are full
    out["tok_s_second_half"] = statistics.median(len(h) / sum(h) for h in
                                                 (r["token_s"][len(r["token_s"]) // 2:] for r in done) if h)
    out["disk_bytes_per_token"] = statistics.median(r["read_bytes"] / r["decode_tokens"] for r in done)
    out["load_s"] = statistics.median(r["load_s"] for r in done)
    out["load_read_bytes"] = statistics.median(r["load_read_bytes"] for r in done)
    tiers = [r.get("host_tier") or {} for r in done]
    reads = sum(t.get("reads", 0) for t in tiers)
    if any(tiers):
        predicted = sum(t.get("predicted_reads", 0) for t in tiers)
        out["tier_bytes_per_token"] = statistics.median(t.get("bytes_read", 0) / r["decode_tokens"]
                                                        for t, r in zip(tiers, done, strict=True))
        out["predicted_read_share"] = predicted / reads if reads else 0.0
        out["predicted_used_share"] = (sum(t.get("predicted_used", 0) for t in tiers) / predicted
                                       if predicted else 0.0)
        out["in_place_per_token"] = statistics.median(t.get("in_place", 0) / r["decode_tokens"]
                                                      for t, r in zip(tiers, done, strict=True))
    return out


def measure(model: Path, a: argparse.Namespace) -> dict[str, object]:
    """The machine, the disk (``--disk``), then ``a.runs`` rounds of the modes, alternating."""
    dev = _block_device(model)
    result: dict[str, object] = {"model": str(model), "model_bytes": model.stat().st_size,
                                 "machine": machine(model), "settings": {k: getattr(a, k) for k in WORKER_FLAGS}}
    if a.disk:
        result["disk"] = disk_profile(model)
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    for i in range(a.runs):
        for mode in a.modes:
            rec = run_one(mode, model, a, dev)
            runs[mode].append(rec)
            if a.json != "-":
                print(f"run {i + 1}/{a.runs} {mode}: {_run_line(rec)}", flush=True)
    result["runs"] = runs
    result["modes"] = {m: summarize(m, r) for m, r in runs.items()}
    s, g = (result["modes"].get(m, {}).get("tok_s") for m in MODES)
    if s and g:
        result["ggmoe_vs_stock"] = g / s
    return result


# --------------------------------------------------------------------------- the report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _run_line(r: dict) -> str:
    b = r["before"]
    state = (f"[before: model {_gib(b['model_cached_bytes'])} cached, Cached {_gib(b['cached_bytes'])}, "
             f"MemAvailable {_gib(b['mem_available_bytes'])}, load {b['loadavg_1m']}]")
    if not r.get("decode_tokens"):
        why = "timed out" if r.get("timed_out") else r.get("error", "no token decoded")
        return f"nothing decoded ({why}) after {r['wall_s']} s {state}"
    tier = r.get("host_tier") or {}
    extra = (f", tier {tier.get('reads', 0)} reads ({tier.get('predicted_reads', 0)} predicted)" if tier else "")
    cut = " (timed out)" if r.get("timed_out") else ""
    return (f"{r['decode_tokens']} tokens at {r['tok_s']:.3f} tok/s{cut}, {_mib(r['read_bytes'] / r['decode_tokens'])}"
            f"/token read, load {r['load_s']:.1f} s{extra} {state}")


def _disk_lines(disk: dict) -> list[str]:
    out = [f"disk (O_DIRECT on the model file): sequential 4 MiB {disk['sequential_4MiB']['bytes_per_s'] / 1e9:.2f} GB/s"]
    for key, v in disk.items():
        if key.startswith("random_"):
            out.append(f"  {key}: {v['bytes_per_s'] / 1e9:.2f} GB/s, {v['ms_per_read']} ms a read")
    return out


def report(res: dict) -> str:
    m = res["machine"]
    d = m["disk"]
    lines = [f"model {res['model']} ({_gib(res['model_bytes'])}) on {m['cpu']}, {m['cores']} cores, "
             f"{_gib(m['ram_bytes'])} RAM, disk {d.get('device')} ({_gib(d.get('bytes', 0))}, "
             f"model {d.get('model') or 'unnamed'}), kernel {m['kernel']}",
             f"settings: {json.dumps(res['settings'])}"]
    if "disk" in res:
        lines += _disk_lines(res["disk"])
    lines.append(f"{'mode':<6} {'runs':>5} {'tok/s':>9} {'2nd half':>9} {'disk/token':>11} {'tier/token':>11} "
                 f"{'predicted':>10} {'used':>6} {'load s':>7}")
    for mode, s in res["modes"].items():
        if not s.get("runs_decoding"):
            lines.append(f"{mode:<6} {s['runs']:>5}  no run decoded a token")
            continue
        tier = (f"{_mib(s['tier_bytes_per_token']):>11} {s['predicted_read_share']:>10.1%} "
                f"{s['predicted_used_share']:>6.1%}" if "tier_bytes_per_token" in s else f"{'-':>11} {'-':>10} {'-':>6}")
        lines.append(f"{mode:<6} {s['runs_decoding']:>5} {s['tok_s']:>9.3f} {s['tok_s_second_half']:>9.3f} "
                     f"{_mib(s['disk_bytes_per_token']):>11} "
                     f"{tier} {s['load_s']:>7.1f}")
    if "ggmoe_vs_stock" in res:
        lines.append(f"ggmoe / stock: {res['ggmoe_vs_stock']:.2f}x decode tokens per second")
    return "\n".join(lines)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path, help="GGUF (default: tools/fixtures/big_model.py's 32 GiB model)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, in order: stock, ggmoe")
    ap.add_argument("--runs", type=int, default=3, help="rounds of the modes (default 3)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per run (default 32)")
    ap.add_argument("--warmup", type=int, default=4, help="decode tokens before the timed ones (default 4)")
    ap.add_argument("--prompt-tokens", type=int, default=8, help="prompt length in tokens (default 8)")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--host-ram", default="16GiB", help="ggmoe's host tier budget (default 16GiB)")
    ap.add_argument("--cache-slots", type=int, help="ggmoe's cache slots per layer (default: its own)")
    ap.add_argument("--policy", help="ggmoe's eviction policy")
    ap.add_argument("--predictor", help="ggmoe's stride predictor (reuse, skip-gate, ...)")
    ap.add_argument("--plan-predictor", help="ggmoe's next-token planner (reuse, eam, expert-map, ...)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take (default 1800)")
    ap.add_argument("--disk", action="store_true", help="time the disk on the model file first")
    ap.add_argument("--json", nargs="?", const="-", help="write the results as JSON to this file (- : stdout)")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.model is None:
        sys.path.insert(0, str(ROOT))  # the repo root: tools.* when run as a file
        from tools.fixtures.big_model import default_path

        a.model = default_path()
    if not a.model.is_file():
        print(f"error: no model at {a.model}; write it with python tools/fixtures/big_model.py", file=sys.stderr)
        return 2
    if a.worker:
        worker(a.worker, a.model, a)
        return 0
    res = measure(a.model, a)
    if a.json == "-":
        print(json.dumps(res, indent=2))
        return 0
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
