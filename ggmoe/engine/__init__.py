"""The engine: llama.cpp through llama-cpp-python with the experts in host memory and the gate hook.

The only subpackage that touches ctypes. Importing it loads llama-cpp-python.
"""

from ggmoe.engine.engine import Engine, EngineConfig, Generation, Timings, gpu_device_name

__all__ = ["Engine", "EngineConfig", "Generation", "Timings", "gpu_device_name"]
