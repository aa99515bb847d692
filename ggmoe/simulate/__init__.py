"""Trace-driven simulation: the engine's cache, policies and (later) queue replayed on traces."""

from ggmoe.simulate.replay import micro_batches, replay

__all__ = ["micro_batches", "replay"]
