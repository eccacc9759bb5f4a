"""The parts that touch a real model: stages, profiler, executor, measurements (PyTorch)."""
