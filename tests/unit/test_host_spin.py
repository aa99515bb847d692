"""Where the host part's hand-off spins before it sleeps (``ggmoe.engine.host_part.host_spin_us``): only where the
spinning threads have cores of their own."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.engine.host_part import HOST_SPIN_ENV, HOST_SPIN_US, host_spin_us

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("n_threads", "threads", "on_gpu", "cores", "spins"), [
    (1, 1, False, 2, True),  # the CPU build: the main graph's one thread and the worker's, a core each
    (2, 1, False, 2, False),  # three threads on two cores: the spinner would take a core the team waits for
    (2, 0, False, 2, False),  # no worker: nothing hands off
    (16, 16, True, 16, False),  # a GPU build's default: the worker on every core, the join beside it
    (16, 15, True, 16, True),  # --host-threads 15: the main thread keeps a core for the join
    (8, 8, True, 16, True),
    (8, 8, False, 16, True),
    (8, 9, False, 16, False),
])
def test_the_hand_off_spins_only_where_its_threads_have_cores(n_threads, threads, on_gpu, cores, spins, monkeypatch):
    monkeypatch.delenv(HOST_SPIN_ENV, raising=False)
    assert host_spin_us(n_threads, threads, on_gpu, cores) == (HOST_SPIN_US if spins else 0)


@pytest.mark.parametrize(("raw", "want"), [("0", 0), ("40", 40), ("100000", 100_000)])
def test_the_environment_sets_the_spin(raw, want, monkeypatch):
    monkeypatch.setenv(HOST_SPIN_ENV, raw)
    assert host_spin_us(2, 1, False, 2) == want


@pytest.mark.parametrize("raw", ["-1", "100001", "1.5", "spin"])
def test_a_bad_spin_is_refused_with_its_name(raw, monkeypatch):
    monkeypatch.setenv(HOST_SPIN_ENV, raw)
    with pytest.raises(UsageError, match=HOST_SPIN_ENV):
        host_spin_us(1, 1, False, 2)


@pytest.mark.parametrize(("n_threads", "threads", "on_gpu", "asked", "said"), [
    (2, 1, False, 1, True),  # the user's worker beside a full team: said, with the threads it needs
    (1, 1, False, 1, False),  # it fits: the hand-off spins, nothing to say
    (16, 16, True, None, False),  # a GPU build's default worker: not the user's choice, nothing said
    (16, 16, True, 16, True),
])
def test_a_hand_off_left_asleep_by_the_users_threads_is_said(n_threads, threads, on_gpu, asked, said, monkeypatch):
    from ggmoe.engine.host_part import host_spin_note

    monkeypatch.delenv(HOST_SPIN_ENV, raising=False)
    spin = host_spin_us(n_threads, threads, on_gpu, 2 if not on_gpu else 16)
    note = host_spin_note(n_threads, threads, on_gpu, asked, spin, 2 if not on_gpu else 16)
    assert (note is not None) == said
    if said:
        assert f"--host-threads {threads}" in note and "sleeps" in note


def test_a_spin_the_environment_set_is_not_second_guessed(monkeypatch):
    from ggmoe.engine.host_part import host_spin_note

    monkeypatch.setenv(HOST_SPIN_ENV, "0")
    assert host_spin_note(2, 1, False, 1, 0, 2) is None
