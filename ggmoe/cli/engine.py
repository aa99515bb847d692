"""``ggmoe engine build`` and ``ggmoe engine status``: the patched llama-cpp-python from an installed package."""

from __future__ import annotations

import json

import click

from ggmoe.base.errors import EngineError
from ggmoe.cli.edge import edge


@click.group()
def engine() -> None:
    """Build, install and check the patched engine (llama-cpp-python with ggmoe's patches).

    \b
    Examples:
      ggmoe engine status
      ggmoe engine build --install
      CMAKE_ARGS="-DGGML_AVX512=OFF" ggmoe engine build --install
      ggmoe engine build --cuda --install       # CMAKE_CUDA_ARCHITECTURES=90 by default
    """


@engine.command()
@click.option("--install", "install_it", is_flag=True, help="pip install the wheel into this Python.")
@click.option("--cuda", is_flag=True, help="Build with -DGGML_CUDA=ON (CMAKE_CUDA_ARCHITECTURES, default 90).")
@click.option("--rebuild", is_flag=True, help="Ignore the cached wheel (~/.cache/ggmoe/engine/).")
@click.option("--check-patches", is_flag=True, help="Only check that the patch series applies.")
@edge
def build(install_it: bool, cuda: bool, rebuild: bool, check_patches: bool) -> None:
    """Build llama-cpp-python with ggmoe's patch series (or reuse the cached wheel).

    CMAKE_ARGS from the environment is added after ggmoe's CMake flags, as
    llama-cpp-python's own install honours it. A build takes several minutes on
    a few cores; the wheel is cached, keyed by version, patches and flags. The
    build is native (GGMOE_NATIVE=0: portable) without ggml's AMX kernels, which
    crash on Sapphire Rapids and later (llama.cpp #20824); GGMOE_AMX=1 keeps them.

    \b
    Examples:
      ggmoe engine build --install
      ggmoe engine build --cuda --install
    """
    from ggmoe.base import engine_build as eb

    if check_patches:  # a failed step is eb.BuildError, an EngineError: the edge prints it
        click.echo(f"all {eb.check_patches()} patches apply")
        return
    wheel = eb.build(install_it, True if cuda else None, rebuild)
    click.echo(str(wheel))
    if install_it:
        info = eb.status()
        if not info.get("patched"):
            raise EngineError(f"the engine was installed but does not load as patched: "
                              f"{info.get('patch_error') or info.get('error')}")
        click.echo(f"engine installed: llama-cpp-python {info.get('version')}, patched")


@engine.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@edge
def status(as_json: bool) -> None:
    """Whether the patched engine is installed: version, patch set, backends and devices.

    Exit status 0 when the installed engine is patched, 1 when not.

    \b
    Examples:
      ggmoe engine status
      ggmoe engine status --json
    """
    from ggmoe.base import engine_build as eb

    info = eb.status()
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        if not info.get("installed"):
            click.echo(f"engine: llama-cpp-python is not installed ({info.get('error')})")
        else:
            click.echo(f"engine: llama-cpp-python {info['version']} at {info['path']}")
            click.echo(f"patched: {'yes' if info.get('patched') else 'no'}"
                       + (f" (build {info['key']})" if info.get("key") else ""))
            if info.get("patched") and info.get("key") and info["key"] != info.get("current_key"):
                click.echo(f"  the patch series or flags changed since (a build now: {info['current_key']}); "
                           f"to update: {eb.COMMAND}")
            if info.get("build_info"):
                for line in info["build_info"].splitlines():
                    click.echo(f"  {line}")
            click.echo(f"gpu offload: {'yes' if info.get('gpu_offload') else 'no'}"
                       + (f" ({info['gpu']})" if info.get("gpu") else ""))
            click.echo(f"backends: {info.get('system_info')}")
            feats = info.get("cpu_features") or []
            amx = [f for f in feats if f.startswith("AMX")]
            click.echo(f"cpu features built in: {' '.join(feats) or 'none reported'}")
            click.echo("amx: " + (f"built in ({' '.join(amx)}; llama.cpp #20824 crashes it on some CPUs)" if amx
                                  else "left out (GGMOE_AMX=1 builds it in; llama.cpp #20824)"))
        click.echo(f"patch series: {len(info['patches_available'])} in {info['patch_dir']}")
        if not info.get("patched"):
            click.echo(f"to build and install the patched engine: {eb.COMMAND}")
    raise SystemExit(0 if info.get("patched") else 1)
