"""The torch-free core: chain model, schedules, the simulator, the optimal solver and baseline strategies."""
