"""``ggmoe calibrate``: measure this machine through the engine and write a hardware profile."""

from __future__ import annotations

import json
import sys

import click

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import check_output, write_text_atomic
from ggmoe.cli.edge import edge
from ggmoe.cli.options import model_arg, model_path, threads_opt, verbose_opt


@click.command()
@model_arg
@click.option("-o", "--out", type=click.Path(dir_okay=False),
              help="Write the profile here (.toml); without it, print it.")
@click.option("--name", default="calibrated", show_default=True, help="The profile's name.")
@click.option("--base", default="pcie4", show_default=True,
              help="Profile whose figures stand in for what this machine cannot measure (no GPU: the link).")
@click.option("--tokens", default=32, show_default=True, type=click.IntRange(4, 4096),
              help="Tokens per timed generation.")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Timed runs per figure (the median is kept).")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements and the profile as JSON.")
@threads_opt
@verbose_opt
@edge
def calibrate(model: str | None, out: str | None, name: str, base: str, tokens: int, repeat: int, as_json: bool,
              threads: int | None, verbose: bool) -> None:
    """Measure copy bandwidth and latency, CPU and GPU rates and the route hook's cost on this machine.

    The result is a hardware profile that --hw takes (run, trace, serve, simulate). On a CPU-only
    machine it measures what exists and takes the GPU and link figures from --base, saying so.

    \b
    Examples:
      ggmoe calibrate -o mymachine.toml
      ggmoe run -p "def fib(n):" --cache-slots 8 --miss-policy auto --hw mymachine.toml
      ggmoe calibrate model.gguf --tokens 64 --json
    """
    import os

    from ggmoe.cache.hardware import load_profile
    from ggmoe.engine.calibrate import calibrate as measure
    from ggmoe.simulate.calibration import profile_from, render

    if not name.strip():
        raise UsageError("--name is empty: give the profile a name")
    path = model_path(model)
    base_profile = load_profile(base)
    if out is not None:
        check_output(out, "-o", suffixes=(".toml",))
    click.echo(f"calibrating on {path.name} ({repeat} runs of {tokens} tokens per figure)...", err=True)
    cal = measure(path, n_threads=threads or os.cpu_count() or 1, n_tokens=tokens, repeat=repeat)
    text = render(cal, base_profile, name)
    if out is not None:
        write_text_atomic(out, text)
    if as_json:
        profile, sources = profile_from(cal, base_profile, name)
        click.echo(json.dumps({"measured": cal.to_dict(), "profile": dataclass_dict(profile),
                               "sources": sources, "written": out}, indent=2))
        return
    click.echo(summary(cal), err=out is None)
    if out is None:
        sys.stdout.write(text)
    else:
        click.echo(f"wrote {out}")


def dataclass_dict(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def summary(cal) -> str:
    gpu = cal.gpu or "none (CPU-only build)"
    lines = [f"GPU            {gpu}", f"CPU            {cal.cpu}",
             f"copy           {cal.copy_bytes_per_s / 1e9:.2f} GB/s, {cal.copy_latency_s * 1e6:.1f} us per copy"
             + ("" if cal.gpu else " (host memcpy)"),
             f"decode (host)  {cal.token_host_s * 1e3:.3f} ms per token, experts on the CPU",
             f"CPU rate       {cal.cpu_bytes_per_s / 1e9:.2f} GB/s of expert weights "
             f"({cal.bytes_per_expert / max(cal.cpu_bytes_per_s, 1) * 1e6:.1f} us per expert of "
             f"{cal.bytes_per_expert} B)",
             f"route hook     {cal.hook_s * 1e6:.1f} us per MoE layer call"]
    if cal.token_device_s is not None:
        lines.insert(4, f"decode (GPU)   {cal.token_device_s * 1e3:.3f} ms per token, every expert resident")
    lines += [f"note           {n}" for n in cal.notes]
    return "\n".join(lines)
