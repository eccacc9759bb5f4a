"""PLACEHOLDER — being written by the strategies helper: store_all, recompute_all, periodic, sqrt_n, revolve,
chen_greedy, each returning a Schedule."""
