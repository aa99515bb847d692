"""A hardware profile from measurements (``ggmoe calibrate``): measured figures, the rest from a base profile.

Kept apart from the measuring (``ggmoe.engine.calibrate``) so the simulator never imports the engine: this
takes the measurement as plain numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from ggmoe.cache.hardware import HardwareProfile, render_profile


class Measured(Protocol):
    """What this reads of a ``ggmoe.engine.calibrate.Calibration``, which the simulator does not import."""

    @property
    def gpu(self) -> str | None: ...
    @property
    def cpu(self) -> str: ...
    @property
    def copy_points(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def copy_bytes_per_s(self) -> float: ...
    @property
    def copy_latency_s(self) -> float: ...
    @property
    def cpu_bytes_per_s(self) -> float: ...
    @property
    def gpu_bytes_per_s(self) -> float | None: ...
    @property
    def hook_s(self) -> float: ...
    @property
    def notes(self) -> tuple[str, ...]: ...
    @property
    def disk_points(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def disk_bytes_per_s(self) -> float | None: ...
    @property
    def disk_latency_s(self) -> float | None: ...


def profile_from(cal: Measured, base: HardwareProfile, name: str, zero_copy: tuple[float, str] | None = None
                 ) -> tuple[HardwareProfile, dict[str, str]]:
    """The profile and, per figure, where it came from (measured here, or ``base``'s value).

    ``cal`` is a ``ggmoe.engine.calibrate.Calibration``; ``zero_copy``: the rate (bytes/s) at which the GPU's
    SMs read pinned host memory and where it was measured (tools/gpu/zero_copy_probe.cu), else ``base``'s.
    """
    machine = f"{cal.gpu} with {cal.cpu}" if cal.gpu else f"{cal.cpu}, no GPU"
    src = {attr: f"from the base profile {base.name!r} (not measurable here)" for attr in
           ("copy_bytes_per_s", "copy_latency_s", "gpu_bytes_per_s", "gpu_launch_s", "gpu_layer_s",
            "cpu_bytes_per_s", "cpu_latency_s", "hook_s")}
    values: dict[str, float] = {}
    if cal.gpu:
        values["copy_bytes_per_s"] = cal.copy_bytes_per_s
        values["copy_latency_s"] = cal.copy_latency_s
        how = f"measured: least-squares line through {len(cal.copy_points)} pinned host-to-device copies"
        src["copy_bytes_per_s"] = src["copy_latency_s"] = how
    else:
        src["copy_bytes_per_s"] = src["copy_latency_s"] = (
            f"from the base profile {base.name!r}: this machine has no GPU (a host memcpy measured "
            f"{cal.copy_bytes_per_s / 1e9:.2f} GB/s)")
    if cal.gpu_bytes_per_s is not None:
        values["gpu_bytes_per_s"] = cal.gpu_bytes_per_s
        values["gpu_launch_s"] = 0.0
        values["gpu_layer_s"] = 0.0
        src["gpu_bytes_per_s"] = ("measured: weights a token reads over its decode time with every expert "
                                  "resident on the GPU")
        src["gpu_launch_s"] = src["gpu_layer_s"] = "0: folded into gpu bytes_per_s by the measurement"
    values["cpu_bytes_per_s"] = cal.cpu_bytes_per_s
    values["cpu_latency_s"] = 0.0
    src["cpu_bytes_per_s"] = ("measured: expert bytes a token reads over the time the host experts add" if cal.gpu
                              else "measured: weights a token reads over its decode time (CPU-only build)")
    src["cpu_latency_s"] = "0: folded into cpu bytes_per_s by the measurement"
    values["hook_s"] = cal.hook_s
    src["hook_s"] = "measured: median seconds of the route callback with every expert cached"
    src["zero_copy_bytes_per_s"] = f"from the base profile {base.name!r} (not measured here)"
    src["disk_bytes_per_s"] = src["disk_latency_s"] = f"from the base profile {base.name!r} (not measured here)"
    if cal.disk_bytes_per_s is not None:
        values["disk_bytes_per_s"], values["disk_latency_s"] = cal.disk_bytes_per_s, cal.disk_latency_s
        src["disk_bytes_per_s"] = src["disk_latency_s"] = (
            f"measured: least-squares line through {len(cal.disk_points)} O_DIRECT reads of the model file")
    if zero_copy is not None:
        values["zero_copy_bytes_per_s"], src["zero_copy_bytes_per_s"] = zero_copy
    profile = dataclasses.replace(base, name=name, description=f"measured by ggmoe calibrate on {machine}",
                                  **values)
    return profile, src


def render(cal: Measured, base: HardwareProfile, name: str, zero_copy: tuple[float, str] | None = None) -> str:
    profile, src = profile_from(cal, base, name, zero_copy)
    notes = "".join(f"# note: {' '.join(n.split())}\n" for n in cal.notes)
    return notes + render_profile(profile, src)
